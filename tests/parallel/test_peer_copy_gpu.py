"""The copy-engine all-reduce on two GPUs: against NCCL's average, and DDPBucketed trained through it. Needs 2 GPUs."""

from __future__ import annotations

import copy
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from lm_systems.parallel.ports import free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


def _on_two_gpus(rank: int, world_size: int, port: int, body_name: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size, timeout=timedelta(seconds=120),
                            device_id=torch.device("cuda", rank))
    try:
        globals()[body_name](rank)
    finally:
        dist.destroy_process_group()


def _averager_matches_nccl(rank: int) -> None:
    from lm_systems.parallel.peer_copy import CopyEngineAverager

    device = torch.device("cuda", rank)
    sizes = [1, 7, 4096, 1_000_003, 3]  # odd parts, one smaller than the world
    averager = CopyEngineAverager()
    arena = averager.allocate(sum(sizes), torch.float32, device, max(sizes))
    slices = arena.split(sizes)
    generator = torch.Generator(device).manual_seed(rank)
    for _ in range(3):  # the inbox is reused across buckets and steps
        arena.copy_(torch.randn(arena.numel(), device=device, generator=generator))
        expected = arena.clone()
        dist.all_reduce(expected, op=dist.ReduceOp.AVG)
        pending = [averager.start(s) for s in slices]
        for p in pending:
            p.wait()
        torch.testing.assert_close(arena, expected, atol=1e-7, rtol=1e-6)
        gathered = [torch.empty_like(arena) for _ in range(2)]
        dist.all_gather(gathered, arena)
        assert torch.equal(gathered[0], gathered[1]), "replicas must hold bitwise-equal averages"


def _bucketed_trains_as_with_nccl(rank: int) -> None:
    from lm_systems.parallel import DDPBucketed

    device = torch.device("cuda", rank)
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).to(device)
    finals = {}
    for allreduce in ("process_group", "copy_engine"):
        model = DDPBucketed(copy.deepcopy(base), bucket_size_mb=0.02, allreduce=allreduce, launch_thread=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(10 + rank)  # each rank its own data
        for _ in range(4):
            optimizer.zero_grad()
            model(torch.randn(8, 64, device=device)).square().mean().backward()
            model.finish_gradient_synchronization()
            optimizer.step()
        model.remove_hooks()
        finals[allreduce] = [p.detach().clone() for p in model.module.parameters()]
    assert len(model.buckets) > 2
    for a, b in zip(finals["process_group"], finals["copy_engine"]):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)
    for p in finals["copy_engine"]:
        gathered = [torch.empty_like(p) for _ in range(2)]
        dist.all_gather(gathered, p)
        assert torch.equal(gathered[0], gathered[1])


@pytest.mark.parametrize("body", ["_averager_matches_nccl", "_bucketed_trains_as_with_nccl"])
def test_copy_engine_all_reduce(body):
    mp.spawn(_on_two_gpus, args=(2, free_port(), body), nprocs=2, join=True)
