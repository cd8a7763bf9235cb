"""fsdp2 (torch FSDP2 through Lightning's ModelParallelStrategy) run through train.py on two gloo processes: it
ends with the weights torch DDP ends with on the same windows, clipping engaged and two micro-batches
accumulated per step, and its checkpoint holds the full weights."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

REPO = Path(__file__).resolve().parents[2]
TINY = ["--model.d_model", "32", "--model.num_layers", "2", "--model.num_heads", "2", "--model.d_ff", "64",
        "--model.context_length", "16", "--model.sample_prompt", "", "--data.generated_stories", "300",
        "--data.vocab_size", "300", "--data.batch_size", "2", "--data.val_batches", "2",
        "--trainer.val_check_interval", "4", "--trainer.enable_progress_bar", "false"]


def train(strategy: str, run_dir: Path, cache_dir: Path) -> dict[str, torch.Tensor]:
    command = [sys.executable, str(REPO / "train.py"), "--strategy", strategy, "--accelerator", "cpu", "--devices", "2",
               "--precision", "32-true", "--max_steps", "4", "--accumulate_grad_batches", "2",
               "--trainer.gradient_clip_val", "0.05", "--trainer.log_every_n_steps", "1", *TINY,
               "--data.cache_dir", str(cache_dir)]
    environment = {k: v for k, v in os.environ.items() if k not in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")}
    done = subprocess.run(command, cwd=run_dir, capture_output=True, text=True, timeout=300, env=environment)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (last,) = run_dir.rglob("last.ckpt")
    checkpoint = torch.load(last, map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] == 4
    return {k: v for k, v in checkpoint["state_dict"].items() if k.startswith("model.")}


@pytest.mark.slow
def test_fsdp2_ends_where_torch_ddp_ends(tmp_path):
    cache_dir = tmp_path / "data_cache"
    runs = {}
    for strategy in ("ddp", "fsdp2"):
        (tmp_path / strategy).mkdir()
        runs[strategy] = train(strategy, tmp_path / strategy, cache_dir)
    assert runs["fsdp2"].keys() == runs["ddp"].keys()
    for name, weight in runs["ddp"].items():
        assert not isinstance(runs["fsdp2"][name], DTensor), "full weights, not shards"
        torch.testing.assert_close(runs["fsdp2"][name], weight, atol=2e-6, rtol=1e-5, msg=name)
