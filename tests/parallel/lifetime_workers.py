"""What the lifetime tests run: every container and the ShardedOptimizer built, used for a step and closed on a gloo
group that is then destroyed.

Run as a script (``python lifetime_workers.py RANK WORLD_SIZE PORT``, the checkout on PYTHONPATH), one process per
rank: the repeat test starts two and reads their exit status.
"""

from __future__ import annotations

import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

from lm_systems.parallel import BucketedDDP, FullyShardedDataParallel, NaiveDDP, PerParameterDDP, ShardedOptimizer

LAUNCH_THREAD_NAME = "lm_systems-launch"
TIMEOUT = timedelta(seconds=60)


def launch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == LAUNCH_THREAD_NAME]


def one_step(container: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad(set_to_none=True)
    container(torch.randn(3, 8)).square().mean().backward()
    container.finish_gradient_synchronization()
    optimizer.step()


def build_use_close_each(rank: int, world_size: int, port: int) -> list[object]:
    """On a new gloo group: each container (the overlapping ones with their launch thread) and the ShardedOptimizer
    built on a second group of all ranks, one step taken, closed; then both groups destroyed. Returns the closed
    objects, which a caller may keep: closed, they no longer hold a group."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=TIMEOUT
    )
    closed: list[object] = []
    try:
        group = dist.new_group(backend="gloo", timeout=TIMEOUT)
        for wrap in (
            lambda m: NaiveDDP(m, process_group=group),
            lambda m: PerParameterDDP(m, process_group=group, launch_thread=True),
            lambda m: BucketedDDP(m, bucket_size_mb=1e-4, process_group=group, launch_thread=True),
            lambda m: FullyShardedDataParallel(m, process_group=group),
        ):
            model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
            with wrap(model) as container:
                closed.append(container)
                if isinstance(container, FullyShardedDataParallel):  # its shards differ by rank: no exchange
                    one_step(container, torch.optim.AdamW(model.parameters(), lr=0.1))
                    continue
                with ShardedOptimizer(model.parameters(), torch.optim.AdamW, process_group=group, lr=0.1) as optimizer:
                    closed.append(optimizer)
                    one_step(container, optimizer)
    finally:
        dist.destroy_process_group()
    return closed


if __name__ == "__main__":
    torch.set_num_threads(1)
    build_use_close_each(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
