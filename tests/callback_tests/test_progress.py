"""The progress bars: no negative epoch total when training by steps, the logged loss read once per logged value
(train.py's use is in tests/test_cli.py)."""

import lightning.pytorch as L
import torch

from callbacks import StepsProgressBar
from callbacks.progress import StepsTQDMProgressBar


def test_progress_bar_has_no_negative_epoch_total():
    """Training by steps leaves max_epochs at -1; Lightning's rich bar read "Epoch 0/-2" there."""
    for max_epochs, expected in ((-1, "Epoch 0"), (3, "Epoch 0/2")):
        bar = StepsProgressBar()
        bar.setup(L.Trainer(max_steps=5, max_epochs=max_epochs, callbacks=[bar], logger=False), None, "fit")
        assert bar._get_train_description(0).strip() == expected


class _CountingTensor(torch.Tensor):
    """A logged tensor that counts its reads to the host (a GPU tensor's float() waits for the GPU)."""

    reads = 0

    def __float__(self) -> float:
        type(self).reads += 1
        return super().__float__()


class _Trainer:
    """What the bar reads of a Trainer; like Lightning's, each read of the logged metrics gives fresh views."""

    loggers: list = []
    progress_bar_metrics: dict = {}

    def __init__(self) -> None:
        self.loss: torch.Tensor | None = None

    @property
    def logged_metrics(self) -> dict:
        return {} if self.loss is None else {"train/loss": self.loss.detach()}


def test_bar_reads_each_logged_loss_once(monkeypatch):
    """Lightning asks for the bar's metrics after every batch; the logged loss is read once per logged value."""
    monkeypatch.setattr(_CountingTensor, "reads", 0)
    bar, trainer = StepsTQDMProgressBar(), _Trainer()
    assert "train/loss" not in bar.get_metrics(trainer, None)
    trainer.loss = torch.tensor(2.5).as_subclass(_CountingTensor)
    for _ in range(5):  # five batches between two logged steps
        assert bar.get_metrics(trainer, None)["train/loss"] == 2.5
    assert _CountingTensor.reads == 1
    trainer.loss = torch.tensor(2.0).as_subclass(_CountingTensor)  # the next logged step
    for _ in range(3):
        assert bar.get_metrics(trainer, None)["train/loss"] == 2.0
    assert _CountingTensor.reads == 2
