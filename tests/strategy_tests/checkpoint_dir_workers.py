"""Two-process zero3 runs that save checkpoint directories, and what the tests compare them with: the full state
each epoch's checkpoint holds, gathered by zero3's own one-file path (all-gathers, no torch.distributed.checkpoint).
Module level, so that the spawned processes can import them."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from strategy_workers import TinyData, TinyLM, join_as_launched_process, make_trainer

from lm_systems.files.checkpoint_io import SafeCheckpointIO


class UnitsTinyLM(TinyLM):
    """TinyLM naming what fsdp2 shards one by one (its hidden layer) inside the module its forward runs (itself),
    and training through that forward (where fsdp2's root hooks gather the rest)."""

    def forward(self, batch) -> torch.Tensor:
        return self.loss(batch)

    def training_step(self, batch, batch_idx):
        return self(batch)

    def sharding_units(self) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
        return self, [self.hidden]

    def configure_model(self) -> None:
        """Built whole in __init__ (Lightning's ModelParallelStrategy, fsdp2's base, asks for this hook)."""


class FullStateAtEpochEnd(Callback):
    """Rank 0 writes ``full_step<N>.pt``: the weights and optimizer state as the epoch's checkpoint saves them
    (Lightning runs checkpoint callbacks after the others, so nothing changes in between)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        sharded = trainer.strategy.model  # the FullyShardedDataParallel
        full = {
            "state_dict": sharded.full_state_dict(),
            "optimizer": sharded.full_optimizer_state_dict(trainer.optimizers[0]),
            "global_step": trainer.global_step,
            "lr_scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
        }
        if trainer.is_global_zero:
            torch.save(full, Path(self.out_dir) / f"full_step{trainer.global_step}.pt")


def save_under_zero3(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """A zero3 run of two epochs keeping a checkpoint directory at the end of each (saved in the background)."""
    join_as_launched_process(rank, world_size, port)
    try:
        checkpoint = ModelCheckpoint(
            dirpath=Path(out_dir) / "ckpt", every_n_epochs=1, save_top_k=-1, save_on_train_epoch_end=True
        )
        trainer = make_trainer(
            "zero3",
            world_size,
            out_dir,
            "zero3",
            callbacks=[FullStateAtEpochEnd(out_dir), checkpoint],
            plugins=[SafeCheckpointIO()],
        )
        trainer.fit(TinyLM(), datamodule=TinyData())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
