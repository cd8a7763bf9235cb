"""What a run says about itself: the model's one line at start-up (and its FLOPs per batch), and the hyperparameters
TensorBoard compares runs by."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Mapping, Optional, Union

import lightning.pytorch as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from lm_systems.attention import describe_attention
from lm_systems.model.config import ModelConfig
from lm_systems.model.shape import DataShape
from lm_systems.model.transformer import TransformerLM


def describe_model(
    model: TransformerLM, size: str, compile: Union[bool, str], data_shape: DataShape, trainer: L.Trainer
) -> tuple[Optional[float], int]:
    """Log the model's line (size, parameters, FLOPs per token, attention, where and in what it trains); return the
    FLOPs of one batch of the data's windows (ThroughputMonitor and MFUMonitor read them) and the parameters, counted
    whole (a sharding strategy has not split them yet)."""
    (batch_size, context), config = data_shape, model.config
    flops_per_token = model.flops_per_token(context)
    flops_per_batch = flops_per_token * batch_size * context if batch_size and context else None
    parameters = model.num_parameters()
    rank_zero_info(
        f"TransformerLM {size}: {parameters / 1e6:.2f}M parameters at vocab {config.vocab_size}, "
        f"{flops_per_token / 1e6:.1f} MFLOP/token (training), "
        f"attention={describe_attention(config.attention, compile)}; training on {_devices(trainer)} in "
        f"{trainer.precision}"
    )
    return flops_per_batch, parameters


def run_hyperparameters(
    hparams: Mapping[str, Any],
    config: ModelConfig,
    trainer: L.Trainer,
    data_shape: DataShape,
    num_parameters: Optional[int],
) -> dict[str, Any]:
    """What TensorBoard's HPARAMS tab compares runs by: the module's training settings with the model's shape
    resolved (the vocabulary the tokenizer gave), its size, and the batches and steps it trains on."""
    batch_size, context = data_shape
    # Not LightningCLI's _instantiator, nor the sample's settings, which change nothing trained.
    settings = {k: v for k, v in hparams.items() if not k.startswith(("_", "sample_"))}
    per_batch = batch_size * context if batch_size and context else None
    tokens = per_batch * trainer.world_size * trainer.accumulate_grad_batches if per_batch else None
    return {
        **settings,
        **asdict(config),
        "parameters": num_parameters,
        "batch_size": batch_size,
        "tokens_per_step": tokens,
        "max_steps": trainer.max_steps,
        "precision": trainer.precision,
        "devices": trainer.world_size,
        "strategy": type(trainer.strategy).__name__,
    }


def _devices(trainer: L.Trainer) -> str:
    """Where ``trainer`` runs, as "cpu" or "2 × NVIDIA H100 80GB HBM3"."""
    device = trainer.strategy.root_device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return f"{trainer.world_size} × {name}" if trainer.world_size > 1 else name
