"""NonFiniteWatch: reads :mod:`lm_systems.training.nonfinite`'s ``NonFiniteGuard`` during training."""

from __future__ import annotations

import lightning.pytorch as L
from typing_extensions import override

from lm_systems.compat.lightning import logs_this_step
from lm_systems.training.nonfinite import NonFiniteGuard


class NonFiniteWatch(L.Callback):
    """Reads ``guard``'s record (one host sync) on logged steps, where Lightning reads the logged values anyway; under
    "skip", also when the limit may be met; and as training ends. Stopping, the error ends in ``advice``."""

    def __init__(self, guard: NonFiniteGuard, advice: str) -> None:
        self._guard = guard
        self._advice = advice

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: object, batch: object, batch_idx: int
    ) -> None:
        if logs_this_step(trainer) or self._guard.check_due():
            self._guard.check(self._advice)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._guard.check(self._advice)
