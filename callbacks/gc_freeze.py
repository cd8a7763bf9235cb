"""GCFreeze: takes the training run's long-lived Python objects out of the garbage collector's full passes."""

from __future__ import annotations

import gc
from typing import Any

import lightning.pytorch as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override


class GCFreeze(Callback):
    """Freezes (``gc.freeze``) every object alive after the first training step, and again after each validation.

    CPython's full collection walks every tracked object. A model compiled by ``torch.compile`` keeps hundreds of
    thousands of them alive (graphs, guards, generated code), and Lightning's loop allocates enough each step to
    set a full pass off every few dozen steps: a host stall of a large part of a step, each time. Frozen objects
    are skipped by every later pass. By the end of the first step the model is built and compiled; a validation
    may compile graphs of its own, so what it leaves alive is frozen too. A collection runs first each time, so
    no garbage is frozen. The run's end (``teardown``, or ``on_exception`` after a failure) unfreezes them, if
    nothing was frozen before the run.
    """

    def __init__(self) -> None:
        super().__init__()
        self._stepped = False  # a training step ended since setup
        self._unfreeze_at_end: bool | None = None  # None until the first freeze

    def _freeze(self) -> None:
        if self._unfreeze_at_end is None:
            self._unfreeze_at_end = gc.get_freeze_count() == 0
        gc.collect()
        gc.freeze()

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if not self._stepped:
            self._stepped = True
            self._freeze()

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING:  # a lone validate() ends right after
            self._freeze()

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._unfreeze()

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._unfreeze()  # Lightning skips the callbacks' teardown after an exception

    def _unfreeze(self) -> None:
        if self._unfreeze_at_end:
            gc.unfreeze()
        self._stepped, self._unfreeze_at_end = False, None
