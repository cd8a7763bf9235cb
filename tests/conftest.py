"""Shared test setup: the `gpu` marker skips without CUDA; tests on two spawned ranks are marked `slow`;
Triton kernels run interpreted on the CPU."""

import os

import pytest
import torch

# Must be set before triton is imported anywhere, so CPU runs can exercise the kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "spawn_two_ranks" in item.fixturenames:  # tests/parallel/conftest.py: two fresh interpreters
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
