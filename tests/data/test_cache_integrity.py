"""A damaged token cache is named and rebuilt; ids outside the vocabulary and undecodable corpora are named errors."""

from __future__ import annotations

import numpy as np
import pytest

from lm_systems.data import datamodule as datamodule_module
from lm_systems.data.corpus import load_corpus, resolve_corpus
from lm_systems.data.datamodule import LMDataModule
from lm_systems.data.windows import TrainWindowStream, ValidationWindows


@pytest.fixture
def build_calls(monkeypatch):
    calls = []
    build = datamodule_module.build_token_cache
    monkeypatch.setattr(datamodule_module, "build_token_cache", lambda *a, **k: calls.append(1) or build(*a, **k))
    return calls


def prepare(corpus, cache_dir) -> LMDataModule:
    module = LMDataModule(corpus=str(corpus), cache_dir=str(cache_dir), vocab_size=300)
    module.prepare_data()
    return module


def truncate(path):
    with open(path, "r+b") as file:
        file.truncate(path.stat().st_size // 2)


def overwrite_with_ff(path):
    path.write_bytes(b"\xff" * path.stat().st_size)  # same size: only the checksum can tell


@pytest.mark.parametrize("damage", [truncate, overwrite_with_ff])
@pytest.mark.parametrize("split", ["train", "validation"])
def test_a_damaged_cache_file_is_named_and_rebuilt(txt_corpus, tmp_path, build_calls, damage, split):
    first = prepare(txt_corpus, tmp_path / "cache")
    expected = np.array(first.token_splits.tokens(split))
    damaged = first.token_splits.path(split)
    damage(damaged)
    with pytest.warns(UserWarning, match=f"{damaged}.*rebuilding it"):
        again = prepare(txt_corpus, tmp_path / "cache")
    assert len(build_calls) == 2
    np.testing.assert_array_equal(again.token_splits.tokens(split), expected)
    prepare(txt_corpus, tmp_path / "cache")  # the rebuilt entry is trusted again
    assert len(build_calls) == 2


def test_ids_outside_the_vocabulary_name_the_file(tmp_path):
    path = tmp_path / "entry" / "train.npy"
    path.parent.mkdir()
    np.save(path, np.arange(200, dtype=np.uint16))
    assert next(iter(TrainWindowStream(path, 8, 4, seed=0, vocab_size=200))).max() < 200
    with pytest.raises(ValueError, match=f"{path}.*outside the tokenizer's 150 ids"):
        next(iter(TrainWindowStream(path, 8, 4, seed=0, vocab_size=150)))
    with pytest.raises(ValueError, match=f"{path}.*outside the tokenizer's 150 ids"):
        next(iter(ValidationWindows(path, np.array([0, 100, 180]), 8, 4, rank=0, world_size=1, vocab_size=150)))


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_an_undecodable_corpus_names_the_flag_the_file_and_the_encoding(tmp_path, suffix):
    path = tmp_path / f"random{suffix}"
    path.write_bytes("a valid start, then ".encode() + bytes(range(128, 256)) * 50)
    source = resolve_corpus(str(path), tmp_path / "cache", 10, 0)
    with pytest.raises(ValueError, match=rf"--data.corpus .*random\{suffix}.*not UTF-8 text \(byte 20 "):
        load_corpus(source, tmp_path / "cache", "text")
