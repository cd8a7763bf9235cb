"""A callback for train.py runs that time checkpoint saves (.ci/gpu_checkpoints.sh):
``--trainer.callbacks+=tests.step_clock.StepClock --trainer.callbacks.out=FILE.json`` writes, at the end of fit,
the wall time between the starts of consecutive training batches (the device synchronised first), each step's
loss, and the process's peak resident host memory."""

from __future__ import annotations

import itertools
import json
import resource
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch


class StepClock(L.Callback):
    """Rank 0 writes ``out``: ``intervals_s`` (batch start to the next batch start: a save's pause falls in the
    interval after its step), ``steps`` (the global step at each batch start), ``losses`` and ``peak_rss_gib``."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.starts: list[float] = []
        self.steps: list[int] = []
        self.losses: list[float] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.starts.append(time.perf_counter())
        self.steps.append(trainer.global_step)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any):
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        record = {
            "steps": self.steps,
            "intervals_s": [b - a for a, b in itertools.pairwise(self.starts)],
            "losses": self.losses,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # Linux: kB
        }
        Path(self.out).write_text(json.dumps(record))
