"""Learning-rate schedule: linear warm-up, then cosine decay to a floor."""

from __future__ import annotations

import math


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
