"""The learning-rate schedule as the docs state it, written apart from lm_systems.training.schedule: what the replays
and the schedule tests compare a run against."""

from __future__ import annotations

import math


def expected_lr_factor(step: int, warmup: int, decay: int, floor: float) -> float:
    """The multiplier of the peak rate that optimizer step ``step`` (0-based) trains with: a straight line from
    1 / (warmup + 1) that reaches the peak at step ``warmup``, then a half cosine from the peak down to ``floor`` at
    step ``decay``, and ``floor`` from there on."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    span = max(decay - warmup, 1)
    angle = math.pi * min(step - warmup, span) / span
    return floor + (1 - floor) * (1 + math.cos(angle)) / 2
