"""Tokens per second and model FLOPs utilisation: Lightning's ThroughputMonitor, set up for token batches."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import torch
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from typing_extensions import override

from lm_systems.compat.lightning import CountingThroughputMonitor, compute_dtype, logs_this_step
from lm_systems.profiling.hardware import peak_flops


def sequences_in_batch(batch: torch.Tensor) -> int:
    """Sequences in a (B, T + 1) token window batch."""
    return batch.size(0)


def tokens_in_batch(batch: torch.Tensor) -> int:
    """Predicted tokens in a (B, T + 1) window batch: B · T (the last column is only a target)."""
    return batch.size(0) * (batch.size(1) - 1)


class _TokensAndMFU(Throughput):
    """Lightning's Throughput reporting two of its numbers, under names that say what they are: ``tokens_per_sec``
    (all devices together) and ``mfu`` (where the peak is known). Its others are these scaled (batches, samples
    and FLOP/s per second) or running counts that the step axis already shows."""

    @override
    def compute(self) -> dict[str, float]:
        metrics = super().compute()
        per_device = f"device{self.separator}"
        tokens_per_sec = metrics.get("items_per_sec", metrics.get(f"{per_device}items_per_sec"))
        mfu = metrics.get(f"{per_device}mfu")
        return {name: value for name, value in (("tokens_per_sec", tokens_per_sec), ("mfu", mfu)) if value is not None}


class _Unlogged(Throughput):
    """Validation, timed so that ThroughputMonitor takes its time out of training's, but not logged: Lightning logs
    it against a count of validation batches, not the training steps every other chart has."""

    @override
    def compute(self) -> dict[str, float]:
        return {}


class MFUMonitor(CountingThroughputMonitor):
    """Logs training tokens/s (``train/tokens_per_sec``, all devices) and MFU (``train/mfu``) every logged step.

    Lightning's ``ThroughputMonitor`` does the bookkeeping: a rolling window of times, and the
    LightningModule's ``flops_per_batch`` (``LitLM`` sets it from ``TransformerLM.flops_per_token``).
    Lightning's waits for the GPU after every training batch to read its clock; this one counts the
    batches in between and reads the clock (after one device synchronisation) only on logged steps, so
    the host keeps running ahead of the GPU. The window is then one of logged steps; time spent validating
    is left out.
    This subclass counts tokens from the (B, T + 1) batches and takes the peak FLOP/s from
    ``lm_systems.profiling.hardware`` (dense rates; Lightning's table has the H200's sparse ones), for the
    precision the trainer runs in: bf16 peak under ``bf16-mixed``, fp32 (or TF32) under ``32-true``.
    Without a known peak (a CPU, an unlisted GPU) there is no MFU; ``available_flops`` is then None.
    """

    def __init__(self, window_size: int = 4, peak_flops_per_s: float | None = None) -> None:
        """``window_size``: logged training steps in the rolling average; tokens/s and MFU appear once the window
        is full;
        ``peak_flops_per_s``: override the device's peak, for a GPU missing from ``lm_systems.profiling.hardware``.
        """
        if window_size < 2:
            raise ValueError(f"MFUMonitor window_size must be >= 2 (a rate needs two points), got {window_size}")
        super().__init__(batch_size_fn=sequences_in_batch, length_fn=tokens_in_batch, window_size=window_size)
        self._peak_override = peak_flops_per_s

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        dtype = compute_dtype(trainer)
        device = trainer.strategy.root_device
        self.available_flops = self._peak_override or peak_flops(device, dtype)
        if self.available_flops is None and device.type == "cuda":
            rank_zero_warn(
                f"MFUMonitor knows no peak FLOP/s for {torch.cuda.get_device_name(device)!r} in {dtype}: "
                "set the callback's peak_flops_per_s to log MFU"
            )
        for stage_key in self.stages():
            kind = _TokensAndMFU if stage_key == RunningStage.TRAINING else _Unlogged
            self.set_throughput(
                stage_key, kind(available_flops=self.available_flops, world_size=trainer.world_size, **self.kwargs)
            )

    @override
    @rank_zero_only
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, *args: Any
    ) -> None:
        if not isinstance(batch, torch.Tensor) or batch.dim() != 2:
            raise TypeError(
                "MFUMonitor expects (B, T + 1) token batches as LMDataModule yields, "
                f"got {type(batch).__name__} {getattr(batch, 'shape', '')}"
            )
        if logs_this_step(trainer):  # what Lightning's own bookkeeping asks below
            super().on_train_batch_end(trainer, pl_module, outputs, batch, *args)
        else:  # count the batch; its time is read with the next logged step's
            self.count_batch(trainer.state.stage, sequences_in_batch(batch), tokens_in_batch(batch))
