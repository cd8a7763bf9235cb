"""`python train.py --strategy zero3` on one GPU (world size 1 over NCCL) in bf16-mixed and 16-mixed, as the user
runs it: weights gathered in bf16 (the default under bf16-mixed, and the example config), or in float32 for autocast
to cast; fused AdamW over the shards."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from lm_systems.files.checkpoint_io import read_checkpoint

REPO = Path(__file__).resolve().parents[2]
# tests/conftest.py's tiny run, somewhat larger.
LARGER = [
    "--model.d_model",
    "64",
    "--model.num_layers",
    "2",
    "--model.d_ff",
    "96",
    "--model.context_length",
    "32",
    "--model.warmup_steps",
    "2",
    "--data.batch_size",
    "8",
    "--trainer.val_check_interval",
    "5",
]
RUNS = {
    "bf16_default": ["--strategy", "zero3", "--precision", "bf16-mixed"],
    "bf16_config": ["-c", str(REPO / "configs" / "strategies" / "zero3.yaml")],
    "fp32_gathers_autocast": [
        "--trainer.strategy",
        "strategies.Zero3Strategy",
        "--trainer.strategy.compute_dtype",
        "fp32",
        "--precision",
        "bf16-mixed",
    ],
    "fp16_grad_scaler": ["--strategy", "zero3", "--precision", "16-mixed"],
}

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


@pytest.mark.parametrize("run", RUNS)
def test_train_py_trains_on_one_gpu(run, tmp_path, train_py):
    done = train_py.run_ok(
        *RUNS[run],
        "--accelerator",
        "gpu",
        "--devices",
        "1",
        "--max_steps",
        "10",
        *train_py.tiny,
        *LARGER,
        "--trainer.callbacks+=tests.strategy_tests.strategy_workers.LossAndWeights",
        f"--trainer.callbacks.out_dir={tmp_path}",
        cwd=tmp_path,
        timeout=540,
    )
    assert re.search(r"^finished +10 steps in ", done.stdout, re.MULTILINE), done.stdout[-2000:]  # the run's summary
    result = torch.load(tmp_path / "rank0.pt")
    losses = result["losses"]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert sum(losses[-2:]) < sum(losses[:2]) - 0.2, losses
    (checkpoint,) = tmp_path.rglob("step=10.ckpt")
    saved = read_checkpoint(checkpoint)
    assert saved["state_dict"].keys() == result["final"].keys()
    for name, value in saved["state_dict"].items():  # full weights, as the unwrapped module holds them
        assert torch.equal(value.cpu(), result["final"][name].cpu()), name
