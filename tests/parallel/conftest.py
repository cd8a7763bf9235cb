"""Spawning two gloo ranks for the container tests."""

from datetime import timedelta

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from lm_systems.parallel.ports import free_port


def _spawn_two_ranks(worker, out_dir) -> None:
    """Run ``worker(rank, 2, port, out_dir)`` on two processes; a failure in either fails the test."""
    mp.spawn(worker, args=(2, free_port(), str(out_dir)), nprocs=2, join=True)


@pytest.fixture(scope="session")
def spawn_two_ranks():
    return _spawn_two_ranks


@pytest.fixture
def single_rank_group():
    """A one-process gloo group in this process, destroyed afterwards."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    yield
    dist.destroy_process_group()
