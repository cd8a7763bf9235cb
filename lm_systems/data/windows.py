"""Token windows as datasets: an endless random stream for training, a fixed strided set for validation.

Both are IterableDatasets that yield whole batches (use ``DataLoader(batch_size=None)``): Lightning
never injects a DistributedSampler into an iterable dataset, so the sharding across ranks done here
is the only one. With DataLoader workers, worker ``w`` of ``W`` produces batches ``w, w + W, ...``;
the DataLoader returns workers' batches round-robin, so the merged order is the serial order.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info


def train_window_starts(
    seed: int, rank: int, world_size: int, batch_index: int, batch_size: int, num_tokens: int, window: int
) -> np.ndarray:
    """Start offsets of training batch ``batch_index`` on ``rank``: a pure function of its arguments.

    Each (seed, world size, rank, batch index) seeds its own generator, so batch ``k`` can be drawn
    without drawing batches ``0 .. k-1`` (resume, DataLoader workers) and ranks draw different windows.
    """
    generator = np.random.default_rng([seed, world_size, rank, batch_index])
    return generator.integers(0, num_tokens - window + 1, size=batch_size)


def validation_window_starts(num_tokens: int, context_length: int, max_windows: int, world_size: int) -> np.ndarray:
    """Start offsets of the validation set: non-overlapping windows, at most ``max_windows``, spread evenly.

    Window ``i`` holds tokens ``[i*T, i*T + T]`` (T + 1 of them), so consecutive windows share one
    token and every token of the split is predicted at most once. The count is cut to a multiple of
    ``world_size`` so every rank runs the same number of batches (unequal counts hang collectives).
    """
    available = (num_tokens - 1) // context_length
    chosen = min(available, max_windows)
    chosen -= chosen % world_size
    # Integer spacing keeps the chosen windows distinct and spread over the whole split.
    indices = np.arange(chosen, dtype=np.int64) * available // max(chosen, 1)
    return indices * context_length


def gather_windows(tokens: np.ndarray, starts: np.ndarray, window: int) -> torch.Tensor:
    """Rows ``tokens[s : s + window]`` for each start ``s``, as a LongTensor (len(starts), window)."""
    positions = starts[:, None] + np.arange(window)  # (B, window)
    return torch.from_numpy(np.asarray(tokens[positions], dtype=np.int64))


def checked_ids(batch: torch.Tensor, vocab_size: int | None, tokens_path: str) -> torch.Tensor:
    """``batch`` unchanged if every id is below ``vocab_size``; otherwise an error naming the damaged file."""
    if vocab_size is not None and batch.numel() and int(batch.max()) >= vocab_size:
        raise ValueError(
            f"token cache file {tokens_path!r} holds id {int(batch.max())}, outside the tokenizer's {vocab_size} ids: "
            f"the file is damaged; delete {str(Path(tokens_path).parent)!r} and it is rebuilt on the next run"
        )
    return batch


def worker_shard() -> tuple[int, int]:
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


class BatchStream(IterableDataset):
    """Endless batches for one rank from ``start_batch`` on, batch ``k`` made by ``batch(source, k)``: a pure function
    of (seed, world size, rank, k), so resuming and DataLoader workers need no state. ``source`` is what ``open``
    gives in the process that iterates (a memmap is opened there, not pickled into a worker whole)."""

    def __init__(
        self, context_length: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1, start_batch: int = 0
    ) -> None:
        self.window = context_length + 1
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.start_batch = start_batch

    def open(self) -> object:
        return None

    def batch(self, source: object, batch_index: int) -> torch.Tensor:
        raise NotImplementedError

    def __iter__(self) -> Iterator[torch.Tensor]:
        source = self.open()
        worker, num_workers = worker_shard()
        for batch_index in itertools.count(self.start_batch + worker, num_workers):
            yield self.batch(source, batch_index)


class TrainWindowStream(BatchStream):
    """Endless batches of random (batch_size, context_length + 1) windows of a token file for one rank.

    With ``vocab_size``, an id at or above it (a damaged cache file) is an error naming the file.
    """

    def __init__(
        self,
        tokens_path: str | Path,
        context_length: int,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        start_batch: int = 0,
        vocab_size: int | None = None,
    ) -> None:
        super().__init__(context_length, batch_size, seed, rank, world_size, start_batch)
        self.tokens_path = str(tokens_path)
        self.vocab_size = vocab_size

    def open(self) -> np.ndarray:
        return np.load(self.tokens_path, mmap_mode="r")

    def batch(self, tokens: np.ndarray, batch_index: int) -> torch.Tensor:
        starts = train_window_starts(
            self.seed, self.rank, self.world_size, batch_index, self.batch_size, len(tokens), self.window
        )
        return checked_ids(gather_windows(tokens, starts, self.window), self.vocab_size, self.tokens_path)


class ValidationBatches(IterableDataset):
    """This rank's share (every ``world_size``-th) of a fixed set of validation rows, in batches: the batch of rows
    ``rows`` made by ``batch(source, rows)``, ``source`` being what ``open`` gives in the process that iterates (as
    ``BatchStream``'s)."""

    def __init__(self, rows: np.ndarray | torch.Tensor, batch_size: int, rank: int, world_size: int) -> None:
        self.rows = rows[rank::world_size]
        self.batch_size = batch_size

    def open(self) -> object:
        return None

    def batch(self, source: object, rows: np.ndarray | torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __len__(self) -> int:
        """Batches on this rank: without a length, Lightning's validation bar read "0/?". (Lightning warns about
        any iterable dataset with one, for workers that would each yield everything; these share the batches out.)"""
        return math.ceil(len(self.rows) / self.batch_size)

    def __iter__(self) -> Iterator[torch.Tensor]:
        source = self.open()
        worker, num_workers = worker_shard()
        for batch_index in range(worker, len(self), num_workers):
            yield self.batch(source, self.rows[batch_index * self.batch_size : (batch_index + 1) * self.batch_size])


class ValidationWindows(ValidationBatches):
    """This rank's share of a fixed set of validation windows of a token file, given by their ``starts``."""

    def __init__(
        self,
        tokens_path: str | Path,
        starts: np.ndarray,
        context_length: int,
        batch_size: int,
        rank: int,
        world_size: int,
        vocab_size: int | None = None,
    ) -> None:
        super().__init__(starts, batch_size, rank, world_size)
        self.tokens_path = str(tokens_path)
        self.vocab_size = vocab_size
        self.window = context_length + 1

    def open(self) -> np.ndarray:
        return np.load(self.tokens_path, mmap_mode="r")

    def batch(self, tokens: np.ndarray, starts: np.ndarray) -> torch.Tensor:
        return checked_ids(gather_windows(tokens, starts, self.window), self.vocab_size, self.tokens_path)
