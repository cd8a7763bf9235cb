"""A one-process gloo group for the container tests (``spawn_two_ranks`` is in tests/conftest.py)."""

from datetime import timedelta

import pytest
import torch.distributed as dist
from lightning.fabric.plugins.environments.lightning import find_free_network_port


@pytest.fixture
def single_rank_group():
    """A one-process gloo group in this process, destroyed afterwards."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{find_free_network_port()}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=60),
    )
    yield
    dist.destroy_process_group()
