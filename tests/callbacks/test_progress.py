"""The progress bars: no negative epoch total when training by steps, the logged loss read once per logged value
(train.py's use is in tests/test_cli.py)."""

from types import SimpleNamespace

import lightning.pytorch as L
import pytest

from callbacks import StepsProgressBar
from callbacks.progress import StepsTQDMProgressBar


def test_progress_bar_has_no_negative_epoch_total():
    """Training by steps leaves max_epochs at -1; Lightning's rich bar read "Epoch 0/-2" there."""
    pytest.importorskip("rich")  # not a dependency: the bar is Lightning's RichProgressBar, which needs it
    for max_epochs, expected in ((-1, "Epoch 0"), (3, "Epoch 0/2")):
        bar = StepsProgressBar()
        bar.setup(L.Trainer(max_steps=5, max_epochs=max_epochs, callbacks=[bar], logger=False), None, "fit")
        assert bar._get_train_description(0).strip() == expected


class _CountingValue:
    """A logged value that counts its reads to the host (a GPU tensor's float() waits for the GPU)."""

    def __init__(self, number: float) -> None:
        self.number, self.reads = number, 0

    def __float__(self) -> float:
        self.reads += 1
        return self.number


def test_bar_reads_each_logged_loss_once():
    """Lightning asks for the bar's metrics after every batch; the logged loss is read once per logged value."""
    bar = StepsTQDMProgressBar()
    trainer = SimpleNamespace(loggers=[], progress_bar_metrics={}, logged_metrics={})
    assert "train/loss" not in bar.get_metrics(trainer, None)
    first = _CountingValue(2.5)
    trainer.logged_metrics["train/loss"] = first
    for _ in range(5):  # five batches between two logged steps
        assert bar.get_metrics(trainer, None)["train/loss"] == 2.5
    assert first.reads == 1
    second = _CountingValue(2.0)
    trainer.logged_metrics["train/loss"] = second
    assert bar.get_metrics(trainer, None)["train/loss"] == 2.0
    assert bar.get_metrics(trainer, None)["train/loss"] == 2.0
    assert (first.reads, second.reads) == (1, 1)
