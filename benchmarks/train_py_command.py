"""The one builder of train.py command lines for the benchmark runners (``benchmarks.scaling``, ``benchmarks.train``):
the flags a user would type for one run, trained by one optimisation recipe, with what a timing leaves out (checkpoint
saves, validation, the closing sample, the progress bar) turned off."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# One optimisation recipe for every benchmarked run, stated to train.py explicitly (the plain loop of
# ``benchmarks.train`` trains by it too).
LR, WARMUP_STEPS, MIN_LR_RATIO, WEIGHT_DECAY, BETAS, CLIP = 3e-4, 5, 0.1, 0.1, (0.9, 0.95), 1.0


@dataclass(frozen=True)
class TrainPyRun:
    """What a benchmark runs through train.py: the model, its input shape, precision and length, where logs go."""

    accelerator: str  # "gpu" or "cpu"
    size: str  # a model size name (``--model.size``)
    context: int
    batch_size: int  # per device
    precision: str
    attention: str
    compile: bool
    max_steps: int
    log_dir: Path


def train_py_args(run: TrainPyRun, *extra: str) -> list[str]:
    """train.py's flags for ``run``, then ``extra``: a runner's own flags, which win where they repeat one
    (LightningCLI takes the last value given)."""
    return [
        "--accelerator",
        run.accelerator,
        "--precision",
        run.precision,
        "--model.size",
        run.size,
        "--model.context_length",
        str(run.context),
        "--model.attention",
        run.attention,
        "--model.compile",
        str(run.compile).lower(),
        "--model.lr",
        str(LR),
        "--model.warmup_steps",
        str(WARMUP_STEPS),
        "--model.min_lr_ratio",
        str(MIN_LR_RATIO),
        "--model.weight_decay",
        str(WEIGHT_DECAY),
        "--model.betas",
        f"[{BETAS[0]}, {BETAS[1]}]",
        "--model.sample_prompt",
        "",
        "--data.batch_size",
        str(run.batch_size),
        "--max_steps",
        str(run.max_steps),
        "--trainer.gradient_clip_val",
        str(CLIP),
        "--trainer.limit_val_batches",
        "0",
        "--trainer.enable_checkpointing",
        "false",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.logger.init_args.save_dir",
        str(run.log_dir),
        *extra,
    ]


def train_py_command(run: TrainPyRun, *extra: str) -> list[str]:
    """``python train.py`` from this checkout with ``train_py_args(run, *extra)``: a run in processes of its own."""
    return [sys.executable, str(REPO / "train.py"), *train_py_args(run, *extra)]
