"""Learning-rate schedule: linear warm-up, then cosine decay to a floor."""

from __future__ import annotations

import math
from typing import Optional

import torch

from lm_systems.errors import InputError


def warmup_cosine(step: int, warmup_steps: int, decay_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak learning rate at ``step``.

    Rises linearly over ``warmup_steps`` (reaching 1 at step ``warmup_steps``), follows a half cosine
    from 1 down to ``min_ratio`` until ``decay_steps``, and stays at ``min_ratio`` after.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if step >= decay_steps:
        return min_ratio
    progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    return min_ratio + 0.5 * (1.0 - min_ratio) * (1.0 + math.cos(math.pi * progress))


def check_schedule(lr: float, min_lr_ratio: float, warmup_steps: int) -> None:
    """The schedule's settings, checked where they enter (LitLM's arguments), naming the flags."""
    if lr <= 0 or not 0 <= min_lr_ratio <= 1 or warmup_steps < 0:
        raise ValueError(
            "need model.lr > 0, 0 <= model.min_lr_ratio <= 1 and model.warmup_steps >= 0, got "
            f"{lr}, {min_lr_ratio}, {warmup_steps}"
        )


def warmup_cosine_schedule(
    optimizer: torch.optim.Optimizer, warmup_steps: int, decay_steps: Optional[int], min_ratio: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """``optimizer``'s learning rates scaled by ``warmup_cosine`` at each step, over ``decay_steps`` (the trainer's
    ``max_steps`` where ``--model.decay_steps`` is unset)."""
    if decay_steps is None or decay_steps <= 0:
        raise InputError("the cosine schedule needs a length: set --max_steps (or --model.decay_steps)")
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, warmup_steps, decay_steps, min_ratio)
    )
