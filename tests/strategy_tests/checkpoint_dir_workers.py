"""Two-process zero3 runs that save checkpoint directories, and what the tests compare them with: the full state
each epoch's checkpoint holds, gathered by zero3's own one-file path (all-gathers, no torch.distributed.checkpoint).
Module level, so that the spawned processes can import them."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from strategy_workers import (
    MICRO_BATCH,
    STEPS_PER_EPOCH,
    TinyData,
    TinyLM,
    join_as_launched_process,
    make_trainer,
)
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lm_systems.files.checkpoint_io import SafeCheckpointIO
from lm_systems.parallel import FullyShardedDataParallel, ShardedOptimizer


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


class FullStateAtTrainStart(Callback):
    """Rank 0 writes ``<tag>_start.pt``: the weights and optimizer state a run starts from once Lightning restored its
    checkpoint, gathered whole by each strategy's own means (none of them torch.distributed.checkpoint)."""

    def __init__(self, out_dir: str, tag: str) -> None:
        self.out_dir, self.tag = out_dir, tag

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        model, optimizer = trainer.strategy.model, trainer.optimizers[0]
        if isinstance(model, FullyShardedDataParallel):  # zero3
            state_dict, optimizer_state = model.full_state_dict(), model.full_optimizer_state_dict(optimizer)
        else:
            state_dict = {name: _whole(value) for name, value in pl_module.state_dict().items()}
            if isinstance(optimizer, ShardedOptimizer):  # zero1
                optimizer.consolidate_state_dict(to=0)
                optimizer_state = optimizer.state_dict() if trainer.is_global_zero else None
            else:  # fsdp2's DTensors, or the whole state
                saved = optimizer.state_dict()
                state = {i: {k: _whole(v) for k, v in values.items()} for i, values in saved["state"].items()}
                optimizer_state = {"state": state, "param_groups": saved["param_groups"]}
        if trainer.is_global_zero:
            record = {"state_dict": state_dict, "optimizer": optimizer_state, "global_step": trainer.global_step}
            torch.save(record, Path(self.out_dir) / f"{self.tag}_start.pt")


def _whole(value: torch.Tensor) -> torch.Tensor:
    return (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu().clone()


RESUMED_ON_TWO = ("fsdp2", "zero1", "bucketed_ddp")
RESUMED_ON_FOUR = ("zero3", "fsdp2", "zero1")


def resume(name: str, world_size: int, out_dir: str, tag: str, data: L.LightningDataModule) -> None:
    """Resume the first epoch's directory under strategy ``name`` for one step, its start state kept as ``tag``."""
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=name,
        max_steps=STEPS_PER_EPOCH + 1,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[FullStateAtTrainStart(out_dir, tag)],
        plugins=[SafeCheckpointIO()],
        use_distributed_sampler=False,
    )
    first_epoch = Path(out_dir) / "ckpt" / f"epoch=0-step={STEPS_PER_EPOCH}.ckpt"
    trainer.fit(UnitsTinyLM(), datamodule=data, ckpt_path=str(first_epoch))


class FourRanksData(TinyData):
    """TinyData's windows dealt over any number of ranks, a micro-batch of MICRO_BATCH each (TinyData's sizes fit
    one and two)."""

    def _loader(self, windows: torch.Tensor) -> DataLoader:
        world_size, rank = self.trainer.world_size, self.trainer.global_rank
        return DataLoader(TensorDataset(windows[rank::world_size]), batch_size=MICRO_BATCH)


def resume_on_four(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """The first epoch's directory, written by two processes, resumed on four under each of RESUMED_ON_FOUR."""
    join_as_launched_process(rank, world_size, port)
    try:
        for name in RESUMED_ON_FOUR:
            resume(name, world_size, out_dir, f"{name}_on_four", FourRanksData())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def save_under_zero3(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """A zero3 run of two epochs keeping a checkpoint directory at the end of each (saved in the background); then
    the first epoch's resumed on the same two processes under each of RESUMED_ON_TWO, one step each."""
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
        for name in RESUMED_ON_TWO:
            resume(name, world_size, out_dir, name, TinyData())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
