"""Small corpora and tokenizers for the data tests (every fixture builds in well under a second), and a count of what
LMDataModule builds."""

from __future__ import annotations

import json
import random

import pytest

from lm_systems.data import preparation
from lm_systems.data.tokenizer import END_OF_TEXT, train_bpe_tokenizer

WORDS = "the cat dog sat ran on a mat under big red sun and then slept ate fish bird flew over hill".split()


def random_documents(count: int, seed: int) -> list[str]:
    """Short documents of random words and punctuation, with odd lengths and some non-ASCII text."""
    rng = random.Random(seed)
    extras = ["café", "naïve", "日本", "🙂", "—", "$3.50"]
    return [
        " ".join(rng.choice(WORDS + extras) for _ in range(rng.randint(3, 40))).capitalize() + rng.choice(".!?")
        for _ in range(count)
    ]


@pytest.fixture
def build_calls(monkeypatch):
    """Counts tokenizer trainings and token-cache builds done by LMDataModule (through its CorpusPreparation)."""
    calls = {"tokenizer": 0, "tokens": 0}

    def counting(name, function):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(preparation, "train_bpe_tokenizer", counting("tokenizer", preparation.train_bpe_tokenizer))
    monkeypatch.setattr(preparation, "build_token_cache", counting("tokens", preparation.build_token_cache))
    return calls


@pytest.fixture(scope="session")
def documents() -> list[str]:
    return random_documents(300, seed=7)


@pytest.fixture(scope="session")
def small_tokenizer(documents):
    return train_bpe_tokenizer(documents, vocab_size=320)


@pytest.fixture
def txt_corpus(tmp_path, documents):
    """A TinyStories-style text file: one document per line, each followed by <|endoftext|>."""
    path = tmp_path / "corpus.txt"
    path.write_text("".join(f"{doc}\n{END_OF_TEXT}" for doc in documents), encoding="utf-8")
    return path


@pytest.fixture
def jsonl_corpus(tmp_path, documents):
    path = tmp_path / "corpus.jsonl"
    path.write_text(
        "".join(json.dumps({"story": doc, "id": i}) + "\n" for i, doc in enumerate(documents)), encoding="utf-8"
    )
    return path
