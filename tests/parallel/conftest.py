"""Spawning two gloo ranks for the container tests."""

import socket

import pytest
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_two_ranks(worker, out_dir) -> None:
    """Run ``worker(rank, 2, port, out_dir)`` on two processes; a failure in either fails the test."""
    mp.spawn(worker, args=(2, _free_port(), str(out_dir)), nprocs=2, join=True)


@pytest.fixture(scope="session")
def spawn_two_ranks():
    return _spawn_two_ranks
