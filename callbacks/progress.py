"""The training progress bar: Lightning's rich bar, without an epoch total that training by steps lacks, and
showing the last logged training loss without waiting for the GPU."""

from __future__ import annotations

from typing import Any, Union

import lightning.pytorch as L
from lightning.pytorch.callbacks import RichProgressBar
from typing_extensions import override

SHOWN_LOGGED_METRICS = ("train/loss",)


class StepsProgressBar(RichProgressBar):
    """Training for ``max_steps`` over an endless stream leaves Lightning's ``max_epochs`` at -1, and its
    rich bar then titled itself "Epoch 0/-2". This one reads "Epoch 0" there (the bar counts the steps);
    with a real epoch budget it is Lightning's. ``train.py`` puts it in place of Lightning's rich bar."""

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs >= 1:
            return super()._get_train_description(current_epoch)
        return f"{f'Epoch {current_epoch}':{len(self.validation_description)}}"

    @override
    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Union[int, str, float, dict[str, float]]]:
        """Lightning's bar metrics plus the last *logged* training loss: values logged with ``prog_bar=True``
        are read from the GPU after every batch (a host sync per step); logged ones were read once, when logged."""
        metrics: dict[str, Any] = super().get_metrics(trainer, pl_module)
        for name in SHOWN_LOGGED_METRICS:
            value = trainer.logged_metrics.get(name)
            if value is not None:
                metrics[name] = float(value)
        return metrics
