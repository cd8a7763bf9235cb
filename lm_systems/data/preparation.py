"""Preparing a corpus for training: its byte-level BPE tokenizer (given, cached or trained) and its token cache entry,
each built once per cache folder however many processes ask."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from lightning.pytorch.utilities import rank_zero_info
from tokenizers import Tokenizer

from lm_systems.data.cache_files import cache_lock
from lm_systems.data.checksums import sidecar_damage
from lm_systems.data.corpus import CorpusSource, LazyCorpus, iter_texts
from lm_systems.data.token_cache import TokenSplits, build_token_cache, open_token_cache, token_cache_entry
from lm_systems.data.tokenizer import load_tokenizer, save_tokenizer, train_bpe_tokenizer
from lm_systems.files.fingerprint import fingerprint

TOKENIZER_TRAINING_CHARS = 200_000_000
"""BPE trains on at most this much of the training text (~10% of TinyStories): plenty for a 10k vocabulary."""


@dataclass(frozen=True)
class PreparedData:
    """What preparation produced: the tokenizer and the complete token cache entry."""

    tokenizer: Tokenizer
    tokens: TokenSplits


@dataclass(frozen=True)
class CorpusPreparation:
    """How one corpus is prepared: ``name`` as the user typed it (``--data.corpus``), its resolved ``source``, the
    cache folder, the text column, the validation share, tokenising processes, and either a tokenizer file or the
    vocabulary size to train one at."""

    name: str
    source: CorpusSource
    cache_dir: Path
    text_column: str
    val_fraction: float
    num_proc: Optional[int]
    tokenizer_path: Optional[str]
    target_vocab_size: int

    def run(self) -> PreparedData:
        """Load or build the tokenizer and the token cache.

        The lock makes concurrent processes (ranks that read ``vocab_size`` before ``prepare_data`` ran on rank 0, or
        two runs sharing a cache) build each entry once; the others then load it.
        """
        corpus = LazyCorpus(self.source, self.cache_dir, self.text_column)  # read only if something must be built
        with cache_lock(self.cache_dir):
            tokenizer = self._load_or_train_tokenizer(corpus)
            entry = token_cache_entry(self.cache_dir, self.source, tokenizer, self.text_column, self.val_fraction)
            tokens = open_token_cache(entry)
            if tokens is None:
                tokens = build_token_cache(
                    entry, corpus.get(), self.source, tokenizer, self.val_fraction, self.num_proc
                )
                rank_zero_info(
                    f"tokenized {self.name!r}: {tokens.meta['tokens']} tokens, vocab {tokens.meta['vocab_size']}, "
                    f"in {tokens.meta['seconds']} s → {entry}"
                )
        return PreparedData(tokenizer, tokens)

    def _load_or_train_tokenizer(self, corpus: LazyCorpus) -> Tokenizer:
        if self.tokenizer_path is not None:
            return load_tokenizer(self.tokenizer_path)
        path = self.cache_dir / "tokenizers" / self._tokenizer_key() / "tokenizer.json"
        if path.is_file():
            problem = sidecar_damage(path)
            if problem is None:
                return load_tokenizer(path)
            warnings.warn(f"the cached tokenizer is damaged: {problem}; training it again", stacklevel=3)
        train_split = corpus.get()["train"]
        rank_zero_info(
            f"training a byte-level BPE of up to {self.target_vocab_size} tokens (--data.vocab_size) on {self.name!r}"
        )
        tokenizer = train_bpe_tokenizer(iter_texts(train_split, TOKENIZER_TRAINING_CHARS), self.target_vocab_size)
        if tokenizer.get_vocab_size() < self.target_vocab_size:
            rank_zero_info(
                f"the BPE stopped at {tokenizer.get_vocab_size()} tokens: every word that occurs twice in "
                f"{self.name!r} is one token already, so no merge is left to learn"
            )
        save_tokenizer(tokenizer, path)
        return tokenizer

    def _tokenizer_key(self) -> str:
        return fingerprint(
            {
                "corpus": self.source.identity,
                "text_column": self.text_column,
                "vocab_size": self.target_vocab_size,
                "training_chars": TOKENIZER_TRAINING_CHARS,
            }
        )
