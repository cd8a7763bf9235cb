"""tests/test_train_py_2gpu.py's train.py runs on four GPUs: `python train.py --devices 4` over NCCL for every
data-parallel strategy in bf16-mixed and 16-mixed against torch DDP on four GPUs (the same windows), all four
replicas identical for the replicated strategies, and bucketed_ddp, zero1 and zero3 resumed from a middle checkpoint
ending where the uninterrupted run ends. The tests are that file's, collected here with ``devices`` 4.
"""

from __future__ import annotations

import pytest
import torch
from test_train_py_2gpu import (  # noqa: F401 (the fixture and tests pytest collects here)
    ddp_run,
    test_resume_ends_where_the_uninterrupted_run_ends,
    test_strategy_trains_like_torch_ddp,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs"),
]


@pytest.fixture(scope="module")
def devices() -> int:
    return 4
