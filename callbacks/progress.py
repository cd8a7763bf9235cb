"""The training progress bars: Lightning's rich and tqdm bars, counting to ``max_steps`` also after a resume, and
showing the last logged training loss without waiting for the GPU (and not the logger's version number)."""

from __future__ import annotations

import importlib.util
from typing import Any, Union

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar
from typing_extensions import override

from lm_systems.compat.lightning import TitledRichProgressBar

SHOWN_LOGGED_METRICS = ("train/loss",)


class _StepsBar(ProgressBar):
    """Training for ``max_steps`` over an endless stream: the bar counts batches from the run's start (a resumed
    run's too), so its total is the whole run's, where Lightning's counts only the steps left. A run resumed
    mid-epoch gets no ``on_train_epoch_start``, which sets the total: Lightning's bar then read "Training: 101/?".
    It also shows the last logged training loss (see ``get_metrics``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._shown: dict[str, tuple[torch.Tensor, float]] = {}  # per shown name: the logged tensor, its float

    @override
    def on_train_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        super().on_train_start(trainer, pl_module)
        if trainer.fit_loop.epoch_loop.batch_progress.current.ready > 0:  # resumed mid-epoch
            self.on_train_epoch_start(trainer, pl_module)

    @property
    @override
    def total_train_batches(self) -> Union[int, float]:
        trainer = self.trainer
        if trainer.max_epochs == -1 and trainer.max_steps is not None and trainer.max_steps > 0:
            return min(trainer.num_training_batches, trainer.max_steps * trainer.accumulate_grad_batches)
        return super().total_train_batches

    @override
    def get_metrics(
        self, trainer: L.Trainer, pl_module: L.LightningModule
    ) -> dict[str, Union[int, str, float, dict[str, float]]]:
        """Lightning's bar metrics plus the last *logged* training loss: values logged with ``prog_bar=True``
        are read from the GPU after every batch (a host sync per step); logged ones were read once, when logged.
        Without Lightning's ``v_num``: a bare number beside the losses; the run's summary names its folder."""
        metrics: dict[str, Any] = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        for name in SHOWN_LOGGED_METRICS:
            value = trainer.logged_metrics.get(name)
            if value is not None:
                metrics[name] = self._as_float(name, value)
        return metrics

    def _as_float(self, name: str, value: Any) -> float:
        """``float(value)``, read from the device once per logged value: Lightning asks for the bar's metrics after
        every batch, and reading a GPU tensor each time would make every step wait for the GPU."""
        if not isinstance(value, torch.Tensor):
            return float(value)
        # Lightning hands out a fresh detached view of the logged tensor each time. Holding the last one keeps its
        # memory from being reused, so the same address means the same logged value.
        held, number = self._shown.get(name, (None, 0.0))
        if held is None or held.data_ptr() != value.data_ptr():
            number = float(value)
            self._shown[name] = (value, number)
        return number


class StepsProgressBar(_StepsBar, TitledRichProgressBar):
    """Training for ``max_steps`` over an endless stream leaves Lightning's ``max_epochs`` at -1, and its
    rich bar then titled itself "Epoch 0/-2". This one reads "Epoch 0" there (the bar counts the steps);
    with a real epoch budget it is Lightning's. ``train.py`` uses it where rich is installed."""

    @override
    def train_description(self, current_epoch: int) -> str:
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs >= 1:
            return super().train_description(current_epoch)
        return f"{f'Epoch {current_epoch}':{len(self.validation_description)}}"


class StepsTQDMProgressBar(_StepsBar, TQDMProgressBar):
    """Lightning's tqdm bar with the whole run's total; ``train.py`` uses it where rich is not installed."""


def steps_progress_bar(refresh_rate: int) -> ProgressBar:
    """Lightning's rich bar where rich is installed, else its tqdm bar, either counting optimizer steps; redrawn every
    ``refresh_rate`` batches."""
    bar = StepsProgressBar if _rich_installed() else StepsTQDMProgressBar
    return bar(refresh_rate=refresh_rate)


def _rich_installed() -> bool:
    return importlib.util.find_spec("rich") is not None
