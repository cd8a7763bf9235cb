"""`python train.py ...` on one GPU, run as the user runs it (a subprocess): every strategy in every precision
with clipping on, compiled, the Triton kernel, resuming exactly, and the shipped configs.

Each run must exit 0, lower the training loss (TensorBoard's train/loss, first logged value against the
last) and leave a checkpoint whose weights load and are finite.
"""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lm_systems.files.checkpoint_io import read_checkpoint

REPO = Path(__file__).resolve().parents[1]
STEPS = 40
SHORT = [
    "--max_steps",
    str(STEPS),
    "--trainer.val_check_interval",
    "20",
    "--trainer.log_every_n_steps",
    "5",
    "--trainer.enable_progress_bar",
    "false",
    "--model.sample_tokens",
    "8",
]
OUR_STRATEGIES = ["naive_ddp", "overlap_ddp", "bucketed_ddp", "zero1", "zero3"]
PRECISIONS = ["32-true", "bf16-mixed", "16-mixed", "bf16-true"]

pytestmark = pytest.mark.gpu


def run(train_py, run_dir: Path, cache_dir: Path, *args: str, timeout: int = 540) -> subprocess.CompletedProcess:
    """``python train.py`` with SHORT and ``args`` (within the test's 600 s limit), which must exit 0."""
    return train_py.run_ok(*SHORT, "--data.cache_dir", str(cache_dir), *args, cwd=run_dir, timeout=timeout)


def version_dir(run_dir: Path) -> Path:
    (events,) = {p.parent for p in run_dir.rglob("events.out.tfevents.*")}
    return events


def logged(run_dir: Path, tag: str) -> list[float]:
    events = EventAccumulator(str(version_dir(run_dir))).Reload()
    return [e.value for e in events.Scalars(tag)]


def assert_trained(run_dir: Path, checkpointed: bool = True) -> dict | None:
    losses = logged(run_dir, "train/loss")
    assert len(losses) >= 2 and all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], losses
    if not checkpointed:
        return None
    checkpoint = read_checkpoint(version_dir(run_dir) / "checkpoints" / "last.ckpt")
    weights = [t for k, t in checkpoint["state_dict"].items() if k.startswith("model.")]
    assert weights and all(torch.isfinite(t).all() for t in weights)
    return checkpoint


def test_the_default_run(tmp_path, cache_dir, train_py):
    run(train_py, tmp_path, cache_dir)
    assert_trained(tmp_path)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("strategy", ["auto", "ddp", *OUR_STRATEGIES])
def test_strategy_and_precision_on_one_gpu(strategy, precision, tmp_path, cache_dir, train_py):
    run(
        train_py,
        tmp_path,
        cache_dir,
        "--strategy",
        strategy,
        "--devices",
        "1",
        "--precision",
        precision,
        "--trainer.gradient_clip_val",
        "1.0",
    )
    assert_trained(tmp_path)


@pytest.mark.parametrize("attention", ["auto", "sdpa", "flash_triton"])
def test_compiled(attention, tmp_path, cache_dir, train_py):
    run(
        train_py,
        tmp_path,
        cache_dir,
        "--model.compile",
        "true",
        "--model.attention",
        attention,
        "--precision",
        "bf16-mixed",
    )
    assert_trained(tmp_path)


def test_flash_triton_attention(tmp_path, cache_dir, train_py):
    done = run(
        train_py,
        tmp_path,
        cache_dir,
        "--model.attention",
        "flash_triton",
        "--precision",
        "bf16-mixed",
        "--strategy",
        "bucketed_ddp",
    )
    assert "attention=flash_triton" in done.stdout + done.stderr
    assert_trained(tmp_path)


def test_resume_from_a_checkpoint_ends_where_the_uninterrupted_run_ended(
    tmp_path, cache_dir, train_py, assert_same_training_state
):
    """Stopped at step 20's checkpoint and resumed to 40 (validating at step 20 in both): the uninterrupted run's
    step=40.ckpt, bit for bit."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    whole.mkdir(), resumed.mkdir()
    run(train_py, whole, cache_dir, "--precision", "bf16-mixed", "--checkpointing_interval", str(STEPS // 2))
    checkpoints = version_dir(whole) / "checkpoints"
    run(
        train_py,
        resumed,
        cache_dir,
        "--precision",
        "bf16-mixed",
        "--ckpt_path",
        str(checkpoints / f"step={STEPS // 2}.ckpt"),
    )
    load = read_checkpoint
    assert_same_training_state(
        load(version_dir(resumed) / "checkpoints" / f"step={STEPS}.ckpt"), load(checkpoints / f"step={STEPS}.ckpt")
    )


@pytest.mark.timeout(960)  # the run's own limit is 900 s
@pytest.mark.parametrize("config", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_shipped_config(config, tmp_path, cache_dir, train_py):
    """Each shipped config for a few steps at its own size and precision (TinyStories' data and the 8B config's
    uniform random tokens swapped for the generated corpus: nothing is downloaded here, and on random tokens no model
    can lower the loss below ln(vocab); a config's devices cut to the GPUs there are); the loss must fall within
    those steps. No checkpoints: the 2.7b one alone would take 40 GB of the test machine's disk."""
    settings = yaml.safe_load((REPO / "configs" / config).read_text())
    extra = ["--data.corpus", "generated"] if config == "tinystories.yaml" else []
    if (settings.get("data") or {}).get("synthetic"):
        extra += ["--data.synthetic", "false", "--data.corpus", "generated"]
    wanted = (settings.get("trainer") or {}).get("devices")
    if isinstance(wanted, int) and wanted > torch.cuda.device_count():  # the 8B config's two GPUs, on one
        extra += ["--trainer.devices", str(torch.cuda.device_count())]
    run(
        train_py,
        tmp_path,
        cache_dir,
        "-c",
        str(REPO / "configs" / config),
        *SHORT,
        *extra,
        "--max_steps",
        "12",
        "--model.warmup_steps",
        "2",
        "--trainer.val_check_interval",
        "12",
        "--trainer.log_every_n_steps",
        "2",
        "--data.val_batches",
        "1",
        "--trainer.accumulate_grad_batches",
        "1",
        "--trainer.enable_checkpointing",
        "false",
        timeout=900,
    )
    assert_trained(tmp_path, checkpointed=False)
