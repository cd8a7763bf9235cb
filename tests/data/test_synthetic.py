"""Synthetic tokens: ids in range, deterministic by seed, different across ranks and batches, resumable, and the same
validation windows on any number of ranks; LMDataModule serves them with no corpus or tokenizer, each rank its own
stream, and a resumed one from where its checkpoint left it."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import torch

from lm_systems.data.datamodule import LMDataModule
from lm_systems.data.synthetic import SyntheticTrainStream, SyntheticValidation


def take(stream, count: int) -> list[torch.Tensor]:
    return list(itertools.islice(iter(stream), count))


def test_batches_are_uniform_ids_in_range_and_a_function_of_seed_rank_and_index():
    batches = take(SyntheticTrainStream(vocab_size=50, context_length=63, batch_size=4, seed=7), 30)
    ids = torch.cat(batches)
    assert batches[0].shape == (4, 64) and batches[0].dtype == torch.int64
    assert ids.min() == 0 and ids.max() == 49
    # Uniform: each of the 50 ids about 1/50 of 7,680 draws (a binomial's sd is ~12 around its 154).
    assert (torch.bincount(ids.flatten(), minlength=50) - ids.numel() / 50).abs().max() < 60
    again = take(SyntheticTrainStream(50, 63, 4, seed=7), 30)
    assert all(torch.equal(a, b) for a, b in zip(batches, again, strict=True))
    assert not torch.equal(batches[0], batches[1])
    other_seed = take(SyntheticTrainStream(50, 63, 4, seed=8), 1)[0]
    rank1 = take(SyntheticTrainStream(50, 63, 4, seed=7, rank=1, world_size=2), 1)[0]
    rank0 = take(SyntheticTrainStream(50, 63, 4, seed=7, rank=0, world_size=2), 1)[0]
    assert not torch.equal(other_seed, batches[0]) and not torch.equal(rank0, rank1)


def test_a_resumed_stream_continues_where_the_whole_one_is():
    whole = take(SyntheticTrainStream(50, 15, 2, seed=3, rank=1, world_size=3), 10)
    resumed = take(SyntheticTrainStream(50, 15, 2, seed=3, rank=1, world_size=3, start_batch=7), 3)
    assert all(torch.equal(a, b) for a, b in zip(whole[7:], resumed, strict=True))


def test_validation_windows_are_the_same_set_on_any_number_of_ranks_and_apart_from_training():
    one = torch.cat(list(SyntheticValidation(50, 15, 3, windows=12, seed=3, rank=0, world_size=1)))
    shares = [
        torch.cat(list(SyntheticValidation(50, 15, 3, windows=12, seed=3, rank=r, world_size=2))) for r in range(2)
    ]
    assert one.shape == (12, 16)
    assert sorted(map(tuple, one.tolist())) == sorted(map(tuple, torch.cat(shares).tolist()))
    training = torch.cat(take(SyntheticTrainStream(50, 15, 3, seed=3), 4))
    assert not any(torch.equal(window, row) for window in one for row in training)


def test_the_datamodule_serves_synthetic_ids_without_a_corpus(tmp_path):
    data = LMDataModule(synthetic=True, vocab_size=151_936, context_length=31, batch_size=2, cache_dir=str(tmp_path))
    data.prepare_data()
    data.setup("fit")
    assert data.vocab_size == 151_936 and data.tokenizer is None and data.eot_id is None
    batch = next(iter(data.train_dataloader()))
    assert batch.shape == (2, 32) and int(batch.max()) < 151_936
    assert len(list(data.val_dataloader())) == data.val_batches
    assert not any(tmp_path.iterdir())  # nothing cached: no corpus, tokenizer or token files


def synthetic_data(tmp_path, rank: int, world_size: int) -> LMDataModule:
    """A synthetic LMDataModule as the trainer of ``rank`` of ``world_size`` holds it."""
    data = LMDataModule(synthetic=True, vocab_size=50, context_length=15, batch_size=2, seed=3, cache_dir=str(tmp_path))
    data.trainer = SimpleNamespace(global_rank=rank, world_size=world_size)
    return data


def test_the_datamodule_serves_each_rank_its_own_stream_and_a_share_of_one_validation_set(tmp_path):
    trained, validated = [], []
    for rank in (0, 1):
        data = synthetic_data(tmp_path, rank, 2)
        trained.append(take(data.train_dataloader(), 3))
        validated += [row for batch in data.val_dataloader() for row in batch.tolist()]
        expected = take(SyntheticTrainStream(50, 15, 2, seed=3, rank=rank, world_size=2), 3)
        assert all(torch.equal(a, b) for a, b in zip(trained[-1], expected, strict=True)), rank
    assert not any(torch.equal(a, b) for a, b in zip(*trained, strict=True))
    alone = [row for batch in synthetic_data(tmp_path, 0, 1).val_dataloader() for row in batch.tolist()]
    assert sorted(validated) == sorted(alone) and len(alone) == 16 * 2  # val_batches 16 × batch 2


def test_a_resumed_datamodule_continues_the_synthetic_stream_where_its_checkpoint_left_it(tmp_path):
    data = synthetic_data(tmp_path, 1, 2)
    data.load_state_dict({"train_batches_consumed": 5})  # what a checkpoint after 5 batches holds
    whole = take(SyntheticTrainStream(50, 15, 2, seed=3, rank=1, world_size=2), 8)
    resumed = take(data.train_dataloader(), 3)
    assert all(torch.equal(a, b) for a, b in zip(resumed, whole[5:], strict=True))
