"""Training and validation windows: contents, shift by one, rank sharding, worker order, validation coverage."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from lm_systems.data.windows import TrainWindowStream, ValidationWindows, train_window_starts, validation_window_starts


@pytest.fixture
def unique_tokens(tmp_path):
    """A token file whose ids are all distinct, so a window's first id tells where it starts."""
    tokens = np.random.default_rng(0).permutation(5003).astype(np.uint16)
    path = tmp_path / "train.npy"
    np.save(path, tokens)
    return path, tokens


def take(stream, count: int) -> list[torch.Tensor]:
    return list(itertools.islice(iter(stream), count))


def assert_windows_of(batch: torch.Tensor, tokens: np.ndarray) -> np.ndarray:
    """Every row is a contiguous run of ``tokens``; returns the start offsets."""
    position = np.argsort(tokens)
    starts = position[batch[:, 0].numpy()]
    for row, start in zip(batch, starts, strict=True):
        np.testing.assert_array_equal(row.numpy(), tokens[start : start + batch.shape[1]])
    return starts


def test_train_batches_are_windows_with_targets_shifted_by_one(unique_tokens):
    path, tokens = unique_tokens
    stream = TrainWindowStream(path, context_length=37, batch_size=5, seed=3)
    for batch in take(stream, 4):
        assert batch.shape == (5, 38) and batch.dtype == torch.int64
        starts = assert_windows_of(batch, tokens)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        # The target at position i is the corpus token right after the input at position i.
        following = np.stack([tokens[s + 1 : s + 38] for s in starts])
        np.testing.assert_array_equal(targets.numpy(), following)
        assert inputs.shape == targets.shape == (5, 37)


def test_windows_reach_both_ends_of_the_split():
    starts = np.concatenate([train_window_starts(0, 0, 1, i, 64, num_tokens=50, window=10) for i in range(20)])
    assert starts.min() == 0 and starts.max() == 40


def test_ranks_draw_different_windows_reproducibly(unique_tokens):
    path, tokens = unique_tokens
    rank0 = take(TrainWindowStream(path, 15, 8, seed=11, rank=0, world_size=2), 6)
    rank1 = take(TrainWindowStream(path, 15, 8, seed=11, rank=1, world_size=2), 6)
    again = take(TrainWindowStream(path, 15, 8, seed=11, rank=1, world_size=2), 6)
    for a, b, c in zip(rank0, rank1, again, strict=True):
        torch.testing.assert_close(b, c, rtol=0, atol=0)
        overlap = set(assert_windows_of(a, tokens)) & set(assert_windows_of(b, tokens))
        assert len(overlap) <= 1, "ranks should see (almost always) different windows"
    other_seed = take(TrainWindowStream(path, 15, 8, seed=12, rank=1, world_size=2), 1)[0]
    assert not torch.equal(other_seed, rank1[0])


def test_stream_started_at_k_continues_the_full_stream(unique_tokens):
    path, _ = unique_tokens
    full = take(TrainWindowStream(path, 9, 3, seed=5, rank=1, world_size=3), 10)
    resumed = take(TrainWindowStream(path, 9, 3, seed=5, rank=1, world_size=3, start_batch=7), 3)
    for a, b in zip(full[7:], resumed, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_dataloader_workers_keep_the_serial_order(unique_tokens):
    path, _ = unique_tokens
    stream = TrainWindowStream(path, 9, 3, seed=5, start_batch=2)
    serial = take(stream, 7)
    loader = DataLoader(stream, batch_size=None, num_workers=2)
    for a, b in zip(serial, take(loader, 7), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize(
    "num_tokens, context_length, max_windows, world_size", [(1001, 16, 1000, 3), (5003, 7, 101, 2), (64, 9, 5, 1)]
)
def test_validation_windows_do_not_overlap_and_spread_over_the_split(
    num_tokens, context_length, max_windows, world_size
):
    starts = validation_window_starts(num_tokens, context_length, max_windows, world_size)
    available = (num_tokens - 1) // context_length
    assert len(starts) == min(available, max_windows) // world_size * world_size
    assert np.all(np.diff(starts) >= context_length), "windows share at most their boundary token"
    assert starts[-1] + context_length + 1 <= num_tokens
    assert starts[-1] >= 0.8 * (num_tokens - context_length - 1), "a capped set must still reach the end of the split"


def test_validation_shards_are_disjoint_equal_and_cover_the_set(tmp_path):
    tokens = np.random.default_rng(1).integers(0, 300, size=997).astype(np.uint16)
    path = tmp_path / "validation.npy"
    np.save(path, tokens)
    starts = validation_window_starts(len(tokens), 11, 1000, world_size=3)
    shards = [list(ValidationWindows(path, starts, 11, batch_size=4, rank=r, world_size=3)) for r in range(3)]
    assert len({len(shard) for shard in shards}) == 1, "every rank must run the same number of batches"
    rows = [row for shard in shards for batch in shard for row in batch.tolist()]
    expected = sorted(tokens[s : s + 12].tolist() for s in starts)
    assert sorted(rows) == expected


def test_validation_windows_with_workers_match_without(tmp_path):
    tokens = np.random.default_rng(2).integers(0, 300, size=500).astype(np.uint16)
    path = tmp_path / "validation.npy"
    np.save(path, tokens)
    dataset = ValidationWindows(path, validation_window_starts(500, 8, 60, 1), 8, batch_size=7, rank=0, world_size=1)
    serial = list(dataset)
    parallel = list(DataLoader(dataset, batch_size=None, num_workers=2))
    assert len(serial) == len(parallel) == len(dataset) == 9
    for a, b in zip(serial, parallel, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
