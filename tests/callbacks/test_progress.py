"""StepsProgressBar: no negative epoch total when training by steps (train.py's use is in tests/test_cli.py)."""

import lightning.pytorch as L
import pytest

from callbacks import StepsProgressBar


def test_progress_bar_has_no_negative_epoch_total():
    """Training by steps leaves max_epochs at -1; Lightning's rich bar read "Epoch 0/-2" there."""
    pytest.importorskip("rich")  # not a dependency: the bar is Lightning's RichProgressBar, which needs it
    for max_epochs, expected in ((-1, "Epoch 0"), (3, "Epoch 0/2")):
        bar = StepsProgressBar()
        bar.setup(L.Trainer(max_steps=5, max_epochs=max_epochs, callbacks=[bar], logger=False), None, "fit")
        assert bar._get_train_description(0).strip() == expected
