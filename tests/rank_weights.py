"""A callback for tests that start train.py: each rank saves its final weights, to compare the ranks' replicas."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as L
import torch


class SaveRankWeights(L.Callback):
    """Writes ``initial_weights_rank<global rank>.pt`` when training starts and ``weights_rank<global rank>.pt``
    when it ends (the module's state dict, this rank's shards under a sharding strategy) into ``out_dir``."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._save(pl_module, f"initial_weights_rank{trainer.global_rank}.pt")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._save(pl_module, f"weights_rank{trainer.global_rank}.pt")

    def _save(self, pl_module: L.LightningModule, name: str) -> None:
        Path(self.out_dir).mkdir(parents=True, exist_ok=True)
        torch.save(pl_module.state_dict(), Path(self.out_dir) / name)
