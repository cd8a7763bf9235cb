"""The containers and the ShardedOptimizer own their lifetimes: closed (or left by ``with``), nothing of their process
group outlives them once it is destroyed, and a container dropped unclosed is not kept alive by its hooks."""

import gc
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from group_threads import group_threads
from lifetime_workers import LAUNCH_THREAD_NAME, build_use_close_each, launch_threads, one_step
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from lm_systems.parallel import BucketedDDP, FullyShardedDataParallel, NaiveDDP, PerParameterDDP, ShardedOptimizer

WORKER = Path(__file__).with_name("lifetime_workers.py")
REPO = Path(__file__).resolve().parents[2]
# Two-process runs of the repeat test: 3 cost about 30 s on two cores loaded by other work (each process spends most of
# its time importing torch); LIFETIME_REPEATS=20 runs the twenty.
REPEATS = int(os.environ.get("LIFETIME_REPEATS", "3"))


def test_no_thread_of_the_group_survives_closed_containers():
    """Kept by the caller after closing (as a trainer keeps its strategy's optimizers), they let the group go."""
    before = group_threads()
    kept = build_use_close_each(rank=0, world_size=1, port=find_free_network_port())
    left = group_threads() - before
    assert len(kept) == 7
    assert not left, f"threads of the destroyed group still running: {dict(left)}"
    assert not launch_threads(), f"a {LAUNCH_THREAD_NAME} thread outlived its container"


@pytest.mark.parametrize(
    "wrap",
    [
        lambda m: NaiveDDP(m),
        lambda m: PerParameterDDP(m, launch_thread=True),
        lambda m: BucketedDDP(m, bucket_size_mb=1e-4, launch_thread=True),
        lambda m: FullyShardedDataParallel(m),
    ],
    ids=["naive", "per_parameter", "bucketed", "fully_sharded"],
)
def test_hooks_do_not_keep_an_unclosed_container_alive(single_rank_group, wrap):
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    container = wrap(model)
    one_step(container, torch.optim.SGD(model.parameters(), lr=0.1))
    alive = weakref.ref(container)
    del container
    gc.collect()
    assert alive() is None, "something (a hook on the module or its parameters) still holds the container"
    model(torch.randn(3, 8)).sum().backward()  # the hooks left behind do nothing once it is gone


def test_a_closed_container_and_optimizer_refuse_to_train(single_rank_group):
    model = nn.Sequential(nn.Linear(8, 2))
    with (
        BucketedDDP(model, launch_thread=True) as container,
        ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.1) as optimizer,
    ):
        one_step(container, optimizer)
    assert not launch_threads()
    with pytest.raises(RuntimeError, match="BucketedDDP was closed"):
        container(torch.randn(3, 8))
    with pytest.raises(RuntimeError, match="ShardedOptimizer was closed"):
        optimizer.step()
    model(torch.randn(3, 8)).sum().backward()  # the module trains on its own, unsynchronised
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.slow
def test_repeated_two_process_runs_end_without_a_signal():
    """Two-process gloo runs that close every container exit cleanly every time, not killed by SIGABRT at exit."""
    for run in range(REPEATS):
        port = str(find_free_network_port())
        ranks = [
            subprocess.Popen(
                [sys.executable, str(WORKER), str(rank), "2", port],
                env={**os.environ, "PYTHONPATH": str(REPO)},  # this checkout's lm_systems, not an installed one
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in range(2)
        ]
        for rank, process in enumerate(ranks):
            _, stderr = process.communicate(timeout=120)
            assert process.returncode == 0, (
                f"run {run}, rank {rank}: exit status {process.returncode}\n{stderr[-2000:]}"
            )
