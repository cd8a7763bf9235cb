"""A callback for tests that start train.py: each rank saves its final weights, to compare the ranks' replicas."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as L
import torch


class SaveRankWeights(L.Callback):
    """Writes ``weights_rank<global rank>.pt`` (the module's state dict) into ``out_dir`` when training ends."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        Path(self.out_dir).mkdir(parents=True, exist_ok=True)
        torch.save(pl_module.state_dict(), Path(self.out_dir) / f"weights_rank{trainer.global_rank}.pt")
