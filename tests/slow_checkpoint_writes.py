"""A callback for train.py runs whose checkpoint directories are written slowly, so that a test can act while a save
is in flight: ``--trainer.callbacks+=tests.slow_checkpoint_writes.SlowCheckpointWrites``."""

from __future__ import annotations

import time

import lightning.pytorch as L
from torch.distributed.checkpoint import FileSystemWriter

from lm_systems.files import checkpoint_dir


class SlowCheckpointWrites(L.Callback):
    """Each rank starts writing its part of each checkpoint directory ``seconds`` late (in the background thread
    that writes it: the loop goes on, and the next save waits for this one)."""

    def __init__(self, seconds: float = 4.0) -> None:
        self.seconds = seconds

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        seconds = self.seconds

        class SlowFileSystemWriter(FileSystemWriter):
            def write_data(self, plan, planner):
                time.sleep(seconds)
                return super().write_data(plan, planner)

        checkpoint_dir.FileSystemWriter = SlowFileSystemWriter

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        checkpoint_dir.FileSystemWriter = FileSystemWriter
