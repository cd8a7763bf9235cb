"""A small LightningModule over random tokens, and a one-call Trainer for the callback tests."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch.utils.data import DataLoader, TensorDataset

from lm_systems.model.config import ModelConfig
from lm_systems.model.transformer import TransformerLM

CONFIG = ModelConfig(
    vocab_size=67, context_length=15, d_model=32, num_layers=2, num_heads=2, d_ff=48, attention="naive"
)
BATCH = 3


class RandomTokenLM(L.LightningModule):
    """TransformerLM on (B, T + 1) random token windows, with ``flops_per_batch`` as LitLM sets it."""

    def __init__(self) -> None:
        super().__init__()
        self.model = TransformerLM(CONFIG)
        self.flops_per_batch = self.model.flops_per_token(CONFIG.context_length) * BATCH * CONFIG.context_length
        self.losses: list[float] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.model(batch[:, :-1])  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.model(batch[:, :-1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def token_loader(batches: int, seed: int = 0) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    windows = torch.randint(0, CONFIG.vocab_size, (batches * BATCH, CONFIG.context_length + 1), generator=generator)
    return DataLoader(
        TensorDataset(windows), batch_size=BATCH, collate_fn=lambda rows: torch.stack([r[0] for r in rows])
    )


def fit(
    module: L.LightningModule,
    callbacks: list,
    tmp_path: Path,
    max_steps: int,
    logger: str = "tensorboard",
    val_batches: int = 0,
    accelerator: str = "cpu",
    **trainer_kwargs,
) -> L.Trainer:
    """Train ``module`` for ``max_steps`` optimizer steps on one ``accelerator``; logs go under ``tmp_path``."""
    loggers = {"tensorboard": TensorBoardLogger(tmp_path, name="run"), "csv": CSVLogger(tmp_path, name="run")}
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=1,
        max_steps=max_steps,
        callbacks=callbacks,
        logger=loggers[logger],
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **trainer_kwargs,
    )
    accumulate = trainer_kwargs.get("accumulate_grad_batches", 1)
    val = token_loader(val_batches, seed=1) if val_batches else None
    trainer.fit(module, train_dataloaders=token_loader(max_steps * accumulate + 2), val_dataloaders=val)
    return trainer
