"""Two-process fits in which one rank receives SIGTERM mid-run, at module level for torch.multiprocessing."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import lightning.pytorch as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException
from strategy_workers import TinyData, TinyLM, join_as_launched_process

SIGNAL_AFTER = 2  # training batches, counted from 1; every batch is an optimizer step
MAX_STEPS = 6


class SigtermAfter(Callback):
    """Rank ``rank`` sends itself SIGTERM once SIGNAL_AFTER batches have ended (as a scheduler or a user might, to that
    process alone); every rank records the batches it trained and the broadcasts made on the default group while
    training."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.batches = 0
        self.default_group_broadcasts = 0
        self._broadcast = dist.broadcast

    def on_train_start(self, trainer, pl_module) -> None:
        def counting(tensor, src=None, group=None, **kwargs):
            if group is None or group is dist.group.WORLD:
                self.default_group_broadcasts += 1
            return self._broadcast(tensor, src=src, group=group, **kwargs)

        dist.broadcast = counting

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batches += 1
        if trainer.global_rank == self.rank and self.batches == SIGNAL_AFTER:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_train_end(self, trainer, pl_module) -> None:
        dist.broadcast = self._broadcast

    def on_exception(self, trainer, pl_module, exception) -> None:
        dist.broadcast = self._broadcast


def run_sigterm(rank: int, world_size: int, port: int, out_dir: str, strategies: list[str]) -> None:
    """For each strategy, two fits: SIGTERM to rank 0, then to rank 1; each rank saves how each fit ended."""
    join_as_launched_process(rank, world_size, port)
    results = {}
    try:
        for strategy in strategies:
            for signalled in (0, 1):
                stopper = SigtermAfter(signalled)
                trainer = L.Trainer(
                    accelerator="cpu",
                    devices=world_size,
                    strategy=strategy,
                    max_steps=MAX_STEPS,
                    limit_val_batches=0,
                    logger=False,
                    enable_checkpointing=False,
                    enable_progress_bar=False,
                    enable_model_summary=False,
                    callbacks=[stopper],
                    use_distributed_sampler=False,
                )
                try:
                    trainer.fit(TinyLM(), datamodule=TinyData())
                    ended = "finished"
                except SIGTERMException:
                    ended = "SIGTERM"
                results[strategy, signalled] = {
                    "ended": ended,
                    "batches": stopper.batches,
                    "global_step": trainer.global_step,
                    "default_group_broadcasts": stopper.default_group_broadcasts,
                }
        torch.save(results, Path(out_dir) / f"sigterm_rank{rank}.pt")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
