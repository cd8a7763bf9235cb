"""What a training checkpoint records besides the weights (the model's configuration, the tokenizer), the refusal to
write one of non-finite weights, and the check that a run resumed from one tokenizes its data the same way."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Optional

import lightning.pytorch as L

from lm_systems.data.tokenizer import tokenizer_mismatch
from lm_systems.errors import InputError
from lm_systems.model.config import ModelConfig
from lm_systems.training.nonfinite import NonFiniteGuard, NonFiniteWeightsError, weights_are_finite


def record_run(checkpoint: dict[str, Any], config: ModelConfig, trainer: L.Trainer) -> None:
    """Add the model's configuration and the data's tokenizer (where it has one) to ``checkpoint``."""
    checkpoint["model_config"] = asdict(config)
    tokenizer = getattr(getattr(trainer, "datamodule", None), "tokenizer", None)
    if tokenizer is not None:
        checkpoint["tokenizer"] = tokenizer.to_str()


def refuse_nonfinite(module: L.LightningModule, trainer: L.Trainer, guard: NonFiniteGuard, advice: str) -> None:
    """Raise where ``guard`` says training must stop (its error ends in ``advice``), and on every rank where any rank's
    weights went non-finite: the ranks agree, so that all of them stop together, none waiting in the save's
    collectives."""
    guard.check(advice)
    if not trainer.strategy.reduce_boolean_decision(weights_are_finite(module.parameters()), all=True):
        raise NonFiniteWeightsError(trainer.global_step)


def check_resumed_tokenizer(checkpoint: dict[str, Any], trainer: Optional[L.Trainer]) -> None:
    """A run resumed by a Trainer must tokenize its data as the checkpoint's run did."""
    tokenizer = getattr(getattr(trainer, "datamodule", None), "tokenizer", None)
    mismatch = tokenizer_mismatch(checkpoint.get("tokenizer"), tokenizer.to_str() if tokenizer else None)
    if mismatch is not None:
        raise InputError(mismatch)
