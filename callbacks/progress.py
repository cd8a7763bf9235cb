"""The training progress bar: Lightning's rich bar, without an epoch total that training by steps lacks."""

from __future__ import annotations

from lightning.pytorch.callbacks import RichProgressBar
from typing_extensions import override


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
