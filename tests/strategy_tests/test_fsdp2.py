"""fsdp2 (torch FSDP2 through Lightning's ModelParallelStrategy) run through train.py on two gloo processes: it
ends with the weights torch DDP ends with on the same windows, clipping engaged and two micro-batches
accumulated per step, and its checkpoint holds the full weights."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from lm_systems.files.checkpoint_io import read_checkpoint


def train(train_py, strategy: str, run_dir: Path) -> dict[str, torch.Tensor]:
    train_py.run_ok(
        *train_py.tiny,
        "--strategy",
        strategy,
        "--accelerator",
        "cpu",
        "--devices",
        "2",
        "--precision",
        "32-true",
        "--max_steps",
        "4",
        "--accumulate_grad_batches",
        "2",
        "--trainer.gradient_clip_val",
        "0.05",
        "--trainer.log_every_n_steps",
        "1",
        "--model.num_layers",
        "2",
        "--data.val_batches",
        "2",
        "--trainer.val_check_interval",
        "4",
        cwd=run_dir,
    )
    (last,) = run_dir.rglob("last.ckpt")
    checkpoint = read_checkpoint(last)
    assert checkpoint["global_step"] == 4
    return {k: v for k, v in checkpoint["state_dict"].items() if k.startswith("model.")}


def test_fsdp2_ends_where_torch_ddp_ends(tmp_path, train_py):
    runs = {}
    for strategy in ("ddp", "fsdp2"):
        (tmp_path / strategy).mkdir()
        runs[strategy] = train(train_py, strategy, tmp_path / strategy)
    assert runs["fsdp2"].keys() == runs["ddp"].keys()
    for name, weight in runs["ddp"].items():
        assert not isinstance(runs["fsdp2"][name], DTensor), "full weights, not shards"
        torch.testing.assert_close(
            runs["fsdp2"][name], weight, atol=2e-6, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )
