"""NVTX ranges around the phases of a training step, for Nsight Systems timelines."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lm_systems.profiling.nvtx import set_nvtx_enabled


class NVTXRanges(Callback):
    """Marks train_step, forward, backward and optimizer_step (plus attention internals) as NVTX ranges.

    Ranges nest as ``train_step > forward | backward | optimizer_step``; forward covers
    ``training_step`` up to the loss. The library's own ranges (``block_i``, and ``attention/scores``,
    ``attention/softmax``, ``attention/weighted_sum`` of the naive attention) are switched on for the
    run. Off the GPU every hook returns at once, so the callback is harmless in CPU runs.

    Use: ``nsys profile -t cuda,nvtx python train.py --trainer.callbacks+=callbacks.NVTXRanges ...``
    """

    def __init__(self, validation: bool = False) -> None:
        """``validation``: also mark each validation step (``validation_step``)."""
        super().__init__()
        self._validation = validation
        self._enabled = False
        self._open: list[str] = []  # names of the pushed, not yet popped ranges: innermost last

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._enabled = self._device_has_nvtx(trainer)
        set_nvtx_enabled(self._enabled)

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._close_all()
        set_nvtx_enabled(False)

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._close_all()
        set_nvtx_enabled(False)

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._push("train_step")
        self._push("forward")

    @override
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        self._pop("forward")
        self._push("backward")

    @override
    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._pop("backward")

    @override
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self._push("optimizer_step")

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # optimizer_step is open only on batches that stepped; forward stays open if training_step
        # returned no loss (no backward), so pop down to train_step whatever is above it.
        while self._open and self._open[-1] != "train_step":
            self._pop(self._open[-1])
        self._pop("train_step")

    @override
    def on_validation_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self._validation:
            self._push("validation_step")

    @override
    def on_validation_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self._validation:
            self._pop("validation_step")

    @staticmethod
    def _device_has_nvtx(trainer: L.Trainer) -> bool:
        return trainer.strategy.root_device.type == "cuda"

    def _push(self, name: str) -> None:
        if self._enabled:
            torch.cuda.nvtx.range_push(name)
            self._open.append(name)

    def _pop(self, name: str) -> None:
        if self._enabled and self._open and self._open[-1] == name:
            torch.cuda.nvtx.range_pop()
            self._open.pop()

    def _close_all(self) -> None:
        while self._open:
            self._pop(self._open[-1])
