"""LMDataModule: corpus → byte-level BPE → cached token memmaps → batches of (B, context_length + 1) windows."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from tokenizers import Tokenizer
from torch.utils.data import DataLoader

from lm_systems.data.cache_files import cache_lock
from lm_systems.data.checksums import sidecar_damage
from lm_systems.data.corpus import CorpusSource, LazyCorpus, iter_texts, resolve_corpus
from lm_systems.data.synthetic import SyntheticTrainStream, SyntheticValidation
from lm_systems.data.token_cache import TokenSplits, build_token_cache, open_token_cache, token_cache_entry
from lm_systems.data.tokenizer import END_OF_TEXT, load_tokenizer, save_tokenizer, train_bpe_tokenizer
from lm_systems.data.windows import TrainWindowStream, ValidationWindows, validation_window_starts
from lm_systems.errors import InputError
from lm_systems.files.fingerprint import fingerprint

TOKENIZER_TRAINING_CHARS = 200_000_000
"""BPE trains on at most this much of the training text (~10% of TinyStories): plenty for a 10k vocabulary."""


@dataclass(frozen=True)
class PreparedData:
    """What preparation produced: the tokenizer and the complete token cache entry."""

    tokenizer: Tokenizer
    tokens: TokenSplits


class LMDataModule(L.LightningDataModule):
    """Random token windows from a tokenised corpus, sharded across ranks and resumable mid-stream.

    Args:
        corpus: ``generated`` (embedded stories, made locally), a ``.txt`` / ``.jsonl`` / ``.json`` /
            ``.parquet`` file, a folder written by ``Dataset.save_to_disk``, or a Hugging Face Hub
            name such as ``roneneldan/TinyStories`` (needs the network once).
        tokenizer: path to a ``tokenizer.json``; None trains a byte-level BPE on the corpus and caches it.
        vocab_size: BPE target size when training a tokenizer (a small corpus stops below it).
        context_length: tokens the model sees per window; batches hold ``context_length + 1`` tokens
            (inputs and next-token targets).
        batch_size: windows per batch on each rank.
        val_fraction: share of the token stream held out for validation when the corpus has no
            validation split of its own.
        val_batches: size of the validation set in batches of ``batch_size``, shared across ranks: the
            same windows are evaluated on any number of devices.
        num_workers: DataLoader worker processes per rank (0 draws batches in the training process).
        num_proc: processes for tokenising; None uses one, whose Rust encoder already uses every core.
        cache_dir: where corpora, tokenizers and token memmaps are cached.
        seed: seeds the training windows (with rank and batch index) and the generated stories.
        text_column: column holding the text in .jsonl / .parquet / saved / hub corpora.
        generated_stories: number of stories in the ``generated`` corpus.
        synthetic: uniform random token ids in [0, vocab_size) instead of a corpus: no tokenizer, no cache, any
            vocabulary and context, deterministic by seed. For timing steps and smoke tests; the loss stays near
            ln(vocab_size) (``lm_systems.data.synthetic``).
    """

    def __init__(
        self,
        corpus: str = "generated",
        tokenizer: Optional[str] = None,
        vocab_size: int = 10_000,
        context_length: int = 128,
        batch_size: int = 16,
        val_fraction: float = 0.05,
        val_batches: int = 16,
        num_workers: int = 0,
        num_proc: Optional[int] = None,
        cache_dir: str = "data_cache",
        seed: int = 1234,
        text_column: str = "text",
        generated_stories: int = 10_000,
        synthetic: bool = False,
    ) -> None:
        super().__init__()
        positive = {"context_length": context_length, "batch_size": batch_size, "val_batches": val_batches}
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"--data.{name} must be positive, got {value}")
        if not 0 < val_fraction < 1:
            raise ValueError(f"--data.val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")
        if num_workers < 0 or (num_proc is not None and num_proc <= 0):
            raise ValueError(
                f"--data.num_workers must be >= 0 and --data.num_proc > 0 or unset, got {num_workers} and {num_proc}"
            )
        if tokenizer is not None and not Path(tokenizer).is_file():
            raise FileNotFoundError(
                f"--data.tokenizer {tokenizer!r} is not a file (pass a tokenizer.json, or leave it unset to train one)"
            )
        self.corpus = corpus
        self.tokenizer_path = tokenizer
        self.target_vocab_size = vocab_size
        self.context_length = context_length
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.val_batches = val_batches
        self.num_workers = num_workers
        self.num_proc = num_proc
        self.cache_dir = Path(cache_dir)
        self.seed = seed
        self.text_column = text_column
        self.generated_stories = generated_stories
        self.synthetic = synthetic
        # Checked now so a typo fails before any model is built; nothing is read yet.
        self._source: CorpusSource | None = (
            None if synthetic else resolve_corpus(corpus, self.cache_dir, generated_stories, seed)
        )
        self._prepared: PreparedData | None = None
        self._train_start_batch = 0

    # -- what the model side reads ---------------------------------------------------------

    @property
    def tokenizer(self) -> Optional[Tokenizer]:
        """The corpus's tokenizer; None for synthetic tokens."""
        return None if self.synthetic else self._prepare().tokenizer

    @property
    def vocab_size(self) -> int:
        """The tokenizer's actual vocabulary (prepares the data on first use); synthetic ids: ``--data.vocab_size``."""
        return self.target_vocab_size if self.synthetic else self._prepare().tokenizer.get_vocab_size()

    @property
    def eot_id(self) -> Optional[int]:
        return None if self.synthetic else self._prepare().tokenizer.token_to_id(END_OF_TEXT)

    @property
    def token_splits(self) -> TokenSplits:
        """The token cache entry: ``.tokens("train")`` / ``.tokens("validation")`` memmaps and ``.meta``."""
        return self._prepare().tokens

    # -- Lightning hooks -------------------------------------------------------------------

    def prepare_data(self) -> None:
        if not self.synthetic:
            self._prepare()

    def setup(self, stage: str) -> None:
        _, world_size = self._rank_and_world_size()
        if self.val_batches * self.batch_size < world_size:
            raise InputError(
                f"--data.val_batches {self.val_batches} × --data.batch_size {self.batch_size} validation windows "
                f"cannot give each of {world_size} ranks one: raise --data.val_batches"
            )
        if self.synthetic:
            return
        counts = self._prepare().tokens.meta["tokens"]
        # train.py links --data.context_length to the model's: the flag to lower there is --model.context_length.
        if counts["train"] < self.context_length + 1:
            raise InputError(
                f"the train split of --data.corpus {self.corpus!r} has {counts['train']} tokens, fewer than one "
                f"window of --data.context_length {self.context_length} + 1: lower --model.context_length (which "
                "sets it) or use a larger corpus"
            )
        if counts["validation"] < world_size * self.context_length + 1:
            raise InputError(
                f"the validation split of --data.corpus {self.corpus!r} has {counts['validation']} tokens, too few "
                f"for one window of --data.context_length {self.context_length} + 1 on each of {world_size} ranks: "
                "lower --model.context_length (which sets it), raise --data.val_fraction or use a larger corpus"
            )

    def train_dataloader(self) -> DataLoader:
        rank, world_size = self._rank_and_world_size()
        if self.synthetic:
            return self._loader(
                SyntheticTrainStream(
                    self.vocab_size,
                    self.context_length,
                    self.batch_size,
                    self.seed,
                    rank,
                    world_size,
                    start_batch=self._train_start_batch,
                )
            )
        stream = TrainWindowStream(
            self._prepare().tokens.path("train"),
            self.context_length,
            self.batch_size,
            self.seed,
            rank,
            world_size,
            start_batch=self._train_start_batch,
            vocab_size=self.vocab_size,
        )
        return self._loader(stream)

    def val_dataloader(self) -> DataLoader:
        rank, world_size = self._rank_and_world_size()
        if self.synthetic:
            return self._loader(
                SyntheticValidation(
                    self.vocab_size,
                    self.context_length,
                    self.batch_size,
                    self.val_batches * self.batch_size,
                    self.seed,
                    rank,
                    world_size,
                )
            )
        tokens = self._prepare().tokens
        starts = validation_window_starts(
            tokens.meta["tokens"]["validation"], self.context_length, self.val_batches * self.batch_size, world_size
        )
        windows = ValidationWindows(
            tokens.path("validation"), starts, self.context_length, self.batch_size, rank, world_size, self.vocab_size
        )
        return self._loader(windows)

    def state_dict(self) -> dict[str, Any]:
        """The data position: training batches this rank has consumed (all ranks consume the same count).

        Counted from the fit loop's progress, not by the dataset: with DataLoader workers and Lightning's
        prefetching, batches are produced ahead of being trained on. ``processed`` includes the batch
        whose ``on_train_batch_end`` is saving the checkpoint, which resuming does not repeat.
        """
        if self.trainer is None:
            return {}
        return {"train_batches_consumed": self.trainer.fit_loop.epoch_loop.batch_progress.total.processed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Lightning restores this before it calls ``train_dataloader()``, which then starts the stream here."""
        self._train_start_batch = int(state_dict.get("train_batches_consumed", 0))

    # -- internals -------------------------------------------------------------------------

    def _rank_and_world_size(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def _loader(self, dataset: torch.utils.data.IterableDataset) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=None,  # the datasets yield whole batches
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
        )

    def _prepare(self) -> PreparedData:
        """Load or build the tokenizer and the token cache, once per process.

        The lock makes concurrent processes (ranks that read ``vocab_size`` before ``prepare_data`` ran
        on rank 0, or two runs sharing a cache) build each entry once; the others then load it.
        """
        if self._prepared is not None:
            return self._prepared
        if self._source is None:
            raise RuntimeError("synthetic data (--data.synthetic true) has no corpus, tokenizer or token cache")
        corpus = LazyCorpus(self._source, self.cache_dir, self.text_column)  # read only if something must be built
        with cache_lock(self.cache_dir):
            tokenizer = self._load_or_train_tokenizer(corpus)
            entry = token_cache_entry(self.cache_dir, self._source, tokenizer, self.text_column, self.val_fraction)
            tokens = open_token_cache(entry)
            if tokens is None:
                tokens = build_token_cache(
                    entry, corpus.get(), self._source, tokenizer, self.val_fraction, self.num_proc
                )
                rank_zero_info(
                    f"tokenized {self.corpus!r}: {tokens.meta['tokens']} tokens, vocab {tokens.meta['vocab_size']}, "
                    f"in {tokens.meta['seconds']} s → {entry}"
                )
        self._prepared = PreparedData(tokenizer, tokens)
        return self._prepared

    def _load_or_train_tokenizer(self, corpus: LazyCorpus) -> Tokenizer:
        if self.tokenizer_path is not None:
            return load_tokenizer(self.tokenizer_path)
        path = self.cache_dir / "tokenizers" / self._tokenizer_key() / "tokenizer.json"
        if path.is_file():
            problem = sidecar_damage(path)
            if problem is None:
                return load_tokenizer(path)
            warnings.warn(f"the cached tokenizer is damaged: {problem}; training it again", stacklevel=2)
        train_split = corpus.get()["train"]
        rank_zero_info(
            f"training a byte-level BPE of up to {self.target_vocab_size} tokens (--data.vocab_size) on {self.corpus!r}"
        )
        texts = iter_texts(train_split, TOKENIZER_TRAINING_CHARS)
        tokenizer = train_bpe_tokenizer(texts, self.target_vocab_size)
        if tokenizer.get_vocab_size() < self.target_vocab_size:
            rank_zero_info(
                f"the BPE stopped at {tokenizer.get_vocab_size()} tokens: every word that occurs twice in "
                f"{self.corpus!r} is one token already, so no merge is left to learn"
            )
        save_tokenizer(tokenizer, path)
        return tokenizer

    def _tokenizer_key(self) -> str:
        return fingerprint(
            {
                "corpus": self._source.identity,
                "text_column": self.text_column,
                "vocab_size": self.target_vocab_size,
                "training_chars": TOKENIZER_TRAINING_CHARS,
            }
        )
