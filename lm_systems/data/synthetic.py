"""Synthetic tokens: uniform random ids at any vocabulary and context, no corpus and no tokenizer.

For benchmarks and smoke tests (as Megatron's mock data and torchtitan's test data): a step's cost depends on the
shapes alone, and a model can learn nothing from these windows, so its loss stays near ln(vocab_size). Batch ``k`` on
rank ``r`` is a pure function of (seed, world size, r, k), so resuming, ranks and DataLoader workers draw as the
windows of a corpus do (``lm_systems.data.windows``).
"""

from __future__ import annotations

import numpy as np
import torch

from lm_systems.data.windows import BatchStream, ValidationBatches

TRAINING, VALIDATION = 0, 1
"""The last number of a generator's key: training and validation batches never share a key."""


def synthetic_batch(key: list[int], batch_size: int, window: int, vocab_size: int) -> torch.Tensor:
    """(batch_size, window) ids drawn uniformly from [0, vocab_size) by a generator seeded with ``key``."""
    generator = np.random.default_rng(key)
    return torch.from_numpy(generator.integers(0, vocab_size, size=(batch_size, window), dtype=np.int64))


class SyntheticTrainStream(BatchStream):
    """Endless (batch_size, context_length + 1) batches of random ids for one rank, from ``start_batch`` on."""

    def __init__(
        self,
        vocab_size: int,
        context_length: int,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        start_batch: int = 0,
    ) -> None:
        super().__init__(context_length, batch_size, seed, rank, world_size, start_batch)
        self.vocab_size = vocab_size

    def batch(self, source: object, batch_index: int) -> torch.Tensor:
        key = [self.seed, self.world_size, self.rank, batch_index, TRAINING]
        return synthetic_batch(key, self.batch_size, self.window, self.vocab_size)


class SyntheticValidation(ValidationBatches):
    """This rank's share of ``windows`` fixed random validation windows; the same windows on any number of ranks."""

    def __init__(
        self, vocab_size: int, context_length: int, batch_size: int, windows: int, seed: int, rank: int, world_size: int
    ) -> None:
        every = synthetic_batch(
            [seed, windows, 0, 0, VALIDATION], windows - windows % world_size, context_length + 1, vocab_size
        )
        super().__init__(every, batch_size, rank, world_size)

    def batch(self, source: object, rows: torch.Tensor) -> torch.Tensor:
        return rows
