"""Wall-clock time of forward, backward, optimizer step and the whole step, with device synchronisation."""

from __future__ import annotations

import csv
import json
import statistics
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lm_systems.compat.lightning import accumulates_this_batch

PHASES = ("forward", "backward", "optimizer", "step")


class StepTimer(Callback):
    """Times ``warmup_steps`` untimed then ``timed_steps`` optimizer steps; writes mean and std per phase.

    Each boundary synchronises the device before reading ``time.perf_counter``, so a phase is charged
    for the kernels it launched rather than for the ones still queued from the phase before. The
    synchronisation stalls the CPU's run-ahead, so timed steps are slightly slower than untimed ones;
    once the timed steps are done the callback stops synchronising.

    - forward: ``training_step`` (forward pass and loss); backward: ``loss.backward()``;
      optimizer: gradient clipping and ``optimizer.step()``; step: batch start to batch end.
      With gradient accumulation, forward and backward sum over the micro-batches of one step.
    - Writes ``step_times_rank{r}.csv`` (one row per timed step, milliseconds) and
      ``step_times_rank{r}.json`` (mean / std / count per phase) into the trainer's log dir, and logs
      ``step_time/<phase>_mean_ms`` and ``_std_ms`` to the logger.
    """

    def __init__(self, warmup_steps: int = 5, timed_steps: int = 10) -> None:
        """``warmup_steps``: optimizer steps run untimed first; ``timed_steps``: steps timed after them."""
        super().__init__()
        if warmup_steps < 0:
            raise ValueError(f"StepTimer warmup_steps must be >= 0, got {warmup_steps}")
        if timed_steps < 1:
            raise ValueError(f"StepTimer timed_steps must be >= 1, got {timed_steps}")
        self._warmup_steps = warmup_steps
        self._timed_steps = timed_steps
        self._out_dir: Path | None = None
        self._rank = 0
        self._on_cuda = False
        self._timing = False
        self._current: dict[str, float] = {}
        self._marks: dict[str, float] = {}
        self.records: list[dict[str, float]] = []
        """One dict of milliseconds per timed step (keys ``PHASES``)."""
        self.summary: dict[str, dict[str, float]] = {}
        """Per phase: ``mean_ms``, ``std_ms``, ``steps``; filled once the timed steps are done."""

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # trainer.log_dir broadcasts from rank 0: read it here, where every rank runs the hook.
        self._out_dir = Path(trainer.log_dir or trainer.default_root_dir)
        self._rank = trainer.global_rank
        self._on_cuda = trainer.strategy.root_device.type == "cuda"

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._timing = self._warmup_steps <= trainer.global_step < self._warmup_steps + self._timed_steps
        if not self._timing:
            return
        now = self._now()
        if not self._current:  # first micro-batch of an optimizer step
            self._current = dict.fromkeys(PHASES, 0.0)
            self._marks["step"] = now
        self._marks["forward"] = now

    @override
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if self._timing:
            now = self._now()
            self._current["forward"] += now - self._marks["forward"]
            self._marks["backward"] = now

    @override
    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._timing:
            self._current["backward"] += self._now() - self._marks["backward"]

    @override
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self._timing:
            self._marks["optimizer"] = self._now()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._timing or accumulates_this_batch(trainer):
            return
        now = self._now()
        if "optimizer" in self._marks:
            self._current["optimizer"] = now - self._marks["optimizer"]
        self._current["step"] = now - self._marks["step"]
        self.records.append({phase: seconds * 1e3 for phase, seconds in self._current.items()})
        self._current, self._marks = {}, {}
        if len(self.records) == self._timed_steps:
            self._finish(trainer)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.summary:
            rank_zero_warn(
                f"StepTimer timed {len(self.records)} of {self._timed_steps} steps after {self._warmup_steps} "
                "warm-up steps: raise --trainer.max_steps or lower the callback's warmup_steps / timed_steps"
            )
            if self.records:
                self._finish(trainer)

    def _now(self) -> float:
        if self._on_cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _finish(self, trainer: L.Trainer) -> None:
        self._timing = False
        for phase in PHASES:
            values = [record[phase] for record in self.records]
            self.summary[phase] = {
                "mean_ms": statistics.fmean(values),
                "std_ms": statistics.stdev(values) if len(values) > 1 else 0.0,
                "steps": len(values),
            }
        self._write_files()
        if trainer.logger is not None:
            metrics = {
                f"step_time/{phase}_{stat}": value
                for phase, stats in self.summary.items()
                for stat, value in stats.items()
                if stat != "steps"
            }
            trainer.logger.log_metrics(metrics, step=trainer.global_step)
        rank_zero_info(
            "StepTimer: "
            + ", ".join(f"{p} {s['mean_ms']:.2f} ± {s['std_ms']:.2f} ms" for p, s in self.summary.items())
            + f" over {len(self.records)} steps; wrote {self._out_dir}/step_times_rank{self._rank}.csv/.json"
        )

    def _write_files(self) -> None:
        assert self._out_dir is not None, "StepTimer.setup was not called"
        self._out_dir.mkdir(parents=True, exist_ok=True)
        stem = self._out_dir / f"step_times_rank{self._rank}"
        with stem.with_suffix(".csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["step", *(f"{p}_ms" for p in PHASES)])
            writer.writeheader()
            for i, record in enumerate(self.records):
                writer.writerow({"step": self._warmup_steps + i, **{f"{p}_ms": record[p] for p in PHASES}})
        summary = {"warmup_steps": self._warmup_steps, "synchronised": self._on_cuda, "phases": self.summary}
        stem.with_suffix(".json").write_text(json.dumps(summary, indent=2))
