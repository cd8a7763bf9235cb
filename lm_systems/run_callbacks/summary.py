"""RunSummary: what a finished run tells a person: its losses, size and speed, where its checkpoint and logs are,
and the commands that open them."""

from __future__ import annotations

import os
import shlex
import time
from typing import Any, Optional

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.loggers import TensorBoardLogger
from typing_extensions import override

from lm_systems.run.logger import log_text


class RunSummary(L.Callback):
    """Prints the run's summary when a fit finishes (and writes it to TensorBoard's TEXT tab as ``summary``).

    Final training and validation loss, steps, tokens, wall time, tokens/s, MFU where a ``ThroughputMonitor``
    (``MFUMonitor``) knows the device's peak, the run's ``last.ckpt`` and log folder, and the ``generate`` (unless
    ``offers_sampling`` is false: synthetic tokens have no tokenizer to decode a sample) and ``tensorboard`` commands
    to paste. Tokens/s counts the training steps after the first (which builds and
    compiles) and leaves validation out; the clock is read after waiting for the GPU, at those few points only.
    Printed at ``teardown``, after the progress bar has stopped (``train.py`` lists this callback after the bar),
    on global rank 0. Expects (B, T + 1) token batches, as ``LMDataModule`` yields.
    """

    def __init__(self, offers_sampling: bool = True) -> None:
        super().__init__()
        self._offers_sampling = offers_sampling
        self._created = time.perf_counter()  # train.py makes its callbacks before preparing data and building the model
        self._reset()

    def _reset(self) -> None:
        self._fit_start = time.perf_counter()
        self._start_step = 0
        self._tokens = 0  # this rank's training tokens
        self._timed_tokens = 0  # ... and FLOPs, after the first step
        self._timed_flops = 0.0
        self._timed_from: Optional[float] = None  # when the first step ended
        self._validating_since: Optional[float] = None
        self._validation_seconds = 0.0  # spent validating after the first step
        self._train_end: Optional[float] = None
        self._val_step: Optional[int] = None  # global step of the last validation

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._reset()

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start_step = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        tokens = batch.size(0) * (batch.size(1) - 1)  # shapes only: no wait for the device
        self._tokens += tokens
        if self._timed_from is not None:
            self._timed_tokens += tokens
            self._timed_flops += getattr(pl_module, "flops_per_batch", None) or 0.0
        elif trainer.global_step > self._start_step:  # the first optimizer step has just ended
            self._timed_from = _clock(trainer)

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking and self._timed_from is not None:
            self._validating_since = _clock(trainer)

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self._val_step = trainer.global_step
        if self._validating_since is not None:
            self._validation_seconds += _clock(trainer) - self._validating_since
            self._validating_since = None

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._train_end = _clock(trainer)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit" or self._train_end is None or not trainer.is_global_zero:
            return
        lines = self.summary_lines(trainer)
        print("\n" + "\n".join(f"{key:<11} {value}" for key, value in lines), flush=True)
        text = "\n".join(f"    {key:<11} {value}" for key, value in lines)  # indented: markdown keeps it as typed
        log_text(trainer.logger, "summary", text, trainer.global_step - 1)

    def summary_lines(self, trainer: L.Trainer) -> list[tuple[str, str]]:
        """The summary as (key, value) lines; valid once the fit has finished."""
        world = trainer.world_size
        steps = trainer.global_step - self._start_step
        resumed = f" (resumed at step {self._start_step}, now {trainer.global_step})" if self._start_step else ""
        lines = [
            ("finished", f"{steps} steps{resumed} in {_duration(time.perf_counter() - self._fit_start)}"),
            ("loss", _losses(trainer, self._val_step)),
            ("tokens", f"{self._tokens * world:,} ({self._tokens // max(steps, 1) * world:,} a step)"),
            *self._speed(trainer),
        ]
        device = trainer.strategy.root_device
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device) / 2**30
            reserved = torch.cuda.max_memory_reserved(device) / 2**30  # the gap to the allocated: fragmentation
            lines.append(
                (
                    "memory",
                    f"{peak:.1f} GiB at most allocated, {reserved:.1f} GiB reserved on rank 0's GPU "
                    "(torch.cuda.max_memory_allocated, max_memory_reserved)",
                )
            )
        checkpoint = getattr(trainer.checkpoint_callback, "last_model_path", "")
        if checkpoint:
            lines.append(("checkpoint", shown_path(checkpoint)))
        logger = trainer.logger
        if isinstance(logger, TensorBoardLogger):
            run = os.path.relpath(logger.log_dir, logger.save_dir)
            lines.append(("logs", f"{shown_path(logger.log_dir)} (TensorBoard run {run})"))
        if checkpoint and self._offers_sampling:
            lines.append(("sample it", f"python -m lm_systems.generate --ckpt {shlex.quote(shown_path(checkpoint))}"))
        if isinstance(logger, TensorBoardLogger):
            lines.append(("view it", f"tensorboard --logdir {shlex.quote(shown_path(logger.save_dir))}"))
        return lines

    def _speed(self, trainer: L.Trainer) -> list[tuple[str, str]]:
        """Tokens/s and MFU lines."""
        if self._timed_from is None or not self._timed_tokens:
            return [("speed", "not measured: the run took one step (the first, which builds the model, is left out)")]
        seconds = self._train_end - self._timed_from - self._validation_seconds
        tokens_per_s = self._timed_tokens * trainer.world_size / seconds
        timed_steps = trainer.global_step - self._start_step - 1
        lines = [
            (
                "speed",
                f"{tokens_per_s:,.0f} tokens/s, {seconds / timed_steps:.3g} s a step (after step 1, validation "
                "left out)",
            ),
            (
                "first step",
                f"done {_duration(self._timed_from - self._created)} after start-up (data, model, "
                "compiling and tuning included)",
            ),
        ]
        monitor = next((c for c in trainer.callbacks if isinstance(c, ThroughputMonitor)), None)
        if monitor is None:
            return lines
        peak = monitor.available_flops
        if not peak:
            device = trainer.strategy.root_device.type
            mfu = f"unknown: no peak FLOP/s known for {device} (MFUMonitor's peak_flops_per_s sets one)"
        else:
            mfu = f"{self._timed_flops / seconds / peak:.1%} of {peak / 1e12:,.0f} TFLOP/s per device"
        return [*lines, ("MFU", mfu)]


def _clock(trainer: L.Trainer) -> float:
    """The time once the device has finished what it was given."""
    if trainer.strategy.root_device.type == "cuda":
        torch.cuda.synchronize(trainer.strategy.root_device)
    return time.perf_counter()


def _losses(trainer: L.Trainer, val_step: Optional[int]) -> str:
    """Final training loss (the last logged) and validation loss (the last validation's), read from the device once;
    each with its step where that is not the last."""

    def at(step: int) -> str:
        return "" if step == trainer.global_step else f" at step {step}"

    metrics = trainer.callback_metrics
    parts = []
    if "train/loss" in metrics:
        # Lightning logs every log_every_n_steps-th step, and the step a run is told to stop at.
        every = trainer.log_every_n_steps
        logged = trainer.global_step if trainer.should_stop else trainer.global_step - trainer.global_step % every
        parts.append(f"train {float(metrics['train/loss']):.3f}{at(logged)}")
    if "val/loss" in metrics and val_step is not None:
        parts.append(f"validation {float(metrics['val/loss']):.3f}{at(val_step)}")
    return ", ".join(parts) or "none logged"


def shown_path(path: str) -> str:
    """``path`` relative to the working directory when it lies below it, else absolute."""
    path = os.path.abspath(path)
    relative = os.path.relpath(path)
    return path if relative.startswith(os.pardir) else relative


def _duration(seconds: float) -> str:
    """``"42.1 s"``, ``"1 min 41 s"``, ``"2 h 05 min"``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, seconds = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"
