"""Warm-up + cosine learning-rate multiplier."""

import itertools
import math

import pytest

from lm_systems.training.schedule import warmup_cosine


def test_warmup_rises_linearly_to_the_peak():
    values = [warmup_cosine(s, warmup_steps=9, decay_steps=100, min_ratio=0.1) for s in range(10)]
    assert values == pytest.approx([(s + 1) / 10 for s in range(10)])


def test_cosine_reaches_the_floor_and_stays():
    assert warmup_cosine(55, 10, 100, 0.1) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert warmup_cosine(100, 10, 100, 0.1) == pytest.approx(0.1)
    assert warmup_cosine(1000, 10, 100, 0.1) == pytest.approx(0.1)
    values = [warmup_cosine(s, 10, 100, 0.1) for s in range(10, 101)]
    assert all(a >= b for a, b in itertools.pairwise(values))
