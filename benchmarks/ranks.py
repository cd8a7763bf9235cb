"""The ranks of a distributed benchmark: one spawned process per rank, joined in a process group, rows back
through a queue.

Rank 0 puts each row on the queue as soon as it has it, so rows measured before a failure or a time limit
still reach the parent, which writes them in any case.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from benchmarks.report import format_value

TIMEOUT = timedelta(minutes=10)  # of every collective: a rank that stops ends the others' wait
Worker = Callable[[Any, torch.device], Iterator[dict]]


def spawn_ranks(worker: Worker, args: Any, nproc: int, backend: str, write: Callable[[list[dict]], None]) -> list[dict]:
    """Run ``worker(args, device)`` on ``nproc`` processes in a ``backend`` group (NCCL: one GPU per rank;
    gloo: one CPU thread per rank). The rows rank 0's worker yields are returned, and given to ``write``
    also when a rank failed (the failure is raised after)."""
    queue = mp.get_context("spawn").SimpleQueue()
    rows: list[dict] = []
    try:
        mp.spawn(
            _run_rank, args=(worker, args, nproc, backend, find_free_network_port(), queue), nprocs=nproc, join=True
        )
    finally:
        while not queue.empty():
            rows.append(queue.get())
        if rows:
            write(rows)
    return rows


def _run_rank(rank: int, worker: Worker, args: Any, nproc: int, backend: str, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(
        backend, rank=rank, world_size=nproc, timeout=TIMEOUT, device_id=device if device.type == "cuda" else None
    )
    try:
        for row in worker(args, device):
            if rank == 0:
                queue.put(row)
                print(", ".join(f"{k} {format_value(v)}" for k, v in row.items()), flush=True)
    finally:
        dist.destroy_process_group()  # every group, the workers' own included
