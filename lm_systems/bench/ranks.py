"""Starting the ranks of a distributed benchmark: one spawned process per rank, rows back through a queue.

Rank 0 puts each result row on the queue as soon as it has it, so rows measured before a failure or a
time limit still reach the parent, which writes them in any case.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lm_systems.parallel.ports import free_port


def spawn_ranks(worker: Callable[..., None], args: Any, nproc: int,
                write: Callable[[list[dict]], None]) -> list[dict]:
    """Run ``worker(rank, args, port, queue)`` on ``nproc`` processes; ``write`` gets the rows put on the
    queue, also when a rank failed (the failure is raised after)."""
    queue = mp.get_context("spawn").SimpleQueue()
    rows: list[dict] = []
    try:
        mp.spawn(worker, args=(args, free_port(), queue), nprocs=nproc, join=True)
    finally:
        while not queue.empty():
            rows.append(queue.get())
        if rows:
            write(rows)
    return rows


def init_rank(rank: int, world_size: int, port: int, backend: str, timeout_s: int) -> torch.device:
    """Join the benchmark's process group; NCCL ranks take GPU ``rank``, gloo ranks one CPU thread each
    (as one GPU per rank)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s),
                            device_id=device if device.type == "cuda" else None)
    return device
