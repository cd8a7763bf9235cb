"""Every cache file is checked whole before use: a damaged generated corpus, tokenizer, meta.json or token file is
named and rebuilt; ids outside the vocabulary and undecodable corpora are named errors."""

from __future__ import annotations

import json
import re
import warnings

import numpy as np
import pytest

from lm_systems.data.corpus import load_corpus, resolve_corpus
from lm_systems.data.datamodule import LMDataModule
from lm_systems.data.token_cache import open_token_cache
from lm_systems.data.tokenizer import END_OF_TEXT, save_tokenizer
from lm_systems.data.windows import TrainWindowStream, ValidationWindows


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
    assert build_calls["tokens"] == 2
    np.testing.assert_array_equal(again.token_splits.tokens(split), expected)
    prepare(txt_corpus, tmp_path / "cache")  # the rebuilt entry is trusted again
    assert build_calls["tokens"] == 2


@pytest.mark.slow
def test_ids_written_anywhere_in_a_large_token_file_are_found(tmp_path, documents, small_tokenizer):
    """A 5 MB train.npy, two bytes changed 100 bytes past its first 64 KiB: between the blocks a sampled
    checksum read (64 of 64 KiB), so the file was trusted."""
    corpus = tmp_path / "big.txt"
    corpus.write_text("".join(f"{doc}\n{END_OF_TEXT}" for doc in documents) * 240, encoding="utf-8")
    tokenizer = save_tokenizer(small_tokenizer, tmp_path / "tokenizer.json")
    first = LMDataModule(corpus=str(corpus), tokenizer=str(tokenizer), cache_dir=str(tmp_path / "cache"))
    train = first.token_splits.path("train")
    assert train.stat().st_size > 5e6
    with open(train, "r+b") as file:
        file.seek(64 * 1024 + 100)
        file.write(b"\xff\xff")
    with pytest.warns(UserWarning, match=f"{train}' differs from what was written in bytes 0–.*rebuilding it"):
        assert open_token_cache(train.parent) is None


@pytest.mark.parametrize(
    "damage", [truncate, lambda path: path.write_text('{"tokens": {"train": 5')], ids=["truncated", "edited"]
)
def test_a_damaged_meta_json_is_named_and_rebuilt(txt_corpus, tmp_path, build_calls, damage):
    meta = prepare(txt_corpus, tmp_path / "cache").token_splits.directory / "meta.json"
    damage(meta)
    with pytest.warns(UserWarning, match=f"{meta}.*rebuilding it"):
        again = prepare(txt_corpus, tmp_path / "cache")
    assert len(build_calls) == 2 and json.loads(meta.read_text())["tokens"] == again.token_splits.meta["tokens"]


def test_a_truncated_generated_corpus_is_named_and_rebuilt(tmp_path):
    """The issue's run: the corpus truncated and the tokens deleted gave 22,745 training tokens, silently."""
    settings = dict(corpus="generated", generated_stories=300, vocab_size=300, cache_dir=str(tmp_path / "cache"))
    whole = LMDataModule(**settings).token_splits.meta["tokens"]
    (corpus,) = (tmp_path / "cache" / "corpora").glob("*.txt")
    truncate(corpus)
    for entry in (tmp_path / "cache" / "tokens").iterdir():
        for path in entry.iterdir():
            path.unlink()
    with pytest.warns(UserWarning, match=f"generated corpus is damaged: '{corpus}' has .* bytes.*rebuilding it"):
        assert LMDataModule(**settings).token_splits.meta["tokens"] == whole


def test_a_damaged_cached_tokenizer_is_named_and_trained_again(tmp_path):
    settings = dict(corpus="generated", generated_stories=300, vocab_size=300, cache_dir=str(tmp_path / "cache"))
    expected = LMDataModule(**settings).tokenizer.to_str()
    (cached,) = (tmp_path / "cache" / "tokenizers").rglob("tokenizer.json")
    cached.write_text(cached.read_text()[:-200])
    with pytest.warns(UserWarning, match=f"cached tokenizer is damaged: '{cached}'.*training it again"):
        assert LMDataModule(**settings).tokenizer.to_str() == expected


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


def overwrite_2000_bytes(path):
    with open(path, "r+b") as file:  # same size, inside the text: only the checksum can tell
        file.seek(path.stat().st_size // 2)
        file.write(b"#" * 2000)


@pytest.mark.parametrize("damage", [truncate, overwrite_2000_bytes])
def test_a_damaged_datasets_arrow_file_is_named_and_prepared_again(txt_corpus, tmp_path, damage):
    source = resolve_corpus(str(txt_corpus), tmp_path / "cache", generated_stories=0, seed=0)
    load_corpus(source, tmp_path / "cache", "text")
    (arrow,) = (tmp_path / "cache" / "hf").rglob("*.arrow")
    damage(arrow)
    with pytest.warns(UserWarning, match=f"the datasets cache is damaged: {re.escape(repr(str(arrow)))}.*preparing"):
        again = load_corpus(source, tmp_path / "cache", "text")
    assert "".join(again["train"]["text"]) == txt_corpus.read_text(encoding="utf-8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # prepared again and recorded: trusted
        load_corpus(source, tmp_path / "cache", "text")
