"""Shared test setup: the `gpu` marker skips without CUDA; Triton kernels run interpreted on the CPU."""

import os

import pytest
import torch

# Must be set before triton is imported anywhere, so CPU runs can exercise the kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
