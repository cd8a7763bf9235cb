"""A callback for train.py runs that makes one rank fail: ``--trainer.callbacks+=tests.failing_rank.FailOnRank``."""

from __future__ import annotations

import lightning.pytorch as L


class FailOnRank(L.Callback):
    """Raises a RuntimeError on global rank ``rank`` as optimizer step ``step`` begins, as a bug there would."""

    def __init__(self, rank: int = 1, step: int = 2) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            raise RuntimeError(f"failure injected on rank {self.rank} at step {self.step}")
