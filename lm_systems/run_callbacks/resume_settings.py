"""What a resumed run keeps and changes, as Lightning hooks: each checkpoint records the run's settings
(``RunConfigRecord``), a resumed run's TensorBoard steps line up with an uninterrupted run's (``ResumedLoggingSteps``),
and it trains with its own optimizer settings (``ThisRunsOptimizerSettings``). How a resume reads its settings is
:mod:`lm_systems.run.resume`'s."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
from jsonargparse import Namespace
from typing_extensions import override

from lm_systems.compat.lightning import align_logging_step
from lm_systems.run.resume import RUN_CONFIG_KEY, flat_settings


class RunConfigRecord(L.Callback):
    """Stores the run's settings in each checkpoint, for a resumed run to say what it changed."""

    def __init__(self, config: Namespace) -> None:
        self._settings = {k: v for k, v in flat_settings(config).items() if not k.startswith("model.")}

    @override
    def on_save_checkpoint(
        self, trainer: "L.Trainer", pl_module: "L.LightningModule", checkpoint: dict[str, Any]
    ) -> None:
        checkpoint[RUN_CONFIG_KEY] = self._settings


class ResumedLoggingSteps(L.Callback):
    """A resumed run's TensorBoard points at the steps an uninterrupted run puts them at (``align_logging_step``)."""

    def __init__(self) -> None:
        self._aligned = False

    @override
    def on_train_batch_start(
        self, trainer: "L.Trainer", pl_module: "L.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        if not self._aligned and trainer.ckpt_path is not None:
            align_logging_step(trainer)
        self._aligned = True


class ThisRunsOptimizerSettings(L.Callback):
    """Lightning restores the optimizer's and the schedule's state with the settings they were saved with (peak
    learning rate, betas, weight decay); a resumed run trains with its own, at the schedule's current step.

    They are read as the fit starts, after ``configure_optimizers`` and before the checkpoint's state is restored;
    the peak learning rate from the scheduler's ``initial_lr`` (the group's ``lr`` already follows the schedule)."""

    def __init__(self) -> None:
        self._settings: list[dict[str, Any]] = []

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._settings = [
            {
                **{k: v for k, v in group.items() if k not in ("params", "initial_lr")},
                "lr": group.get("initial_lr", group["lr"]),
            }
            for group in trainer.optimizers[0].param_groups
        ]

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.ckpt_path is None:
            return
        optimizer, scheduler = trainer.optimizers[0], trainer.lr_scheduler_configs[0].scheduler
        for group, settings in zip(optimizer.param_groups, self._settings, strict=True):
            group.update(settings, initial_lr=settings["lr"])
        scheduler.base_lrs = [settings["lr"] for settings in self._settings]
        for group, base_lr, factor in zip(
            optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True
        ):
            group["lr"] = base_lr * factor(scheduler.last_epoch)
