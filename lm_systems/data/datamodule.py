"""LMDataModule: corpus → byte-level BPE → cached token memmaps → batches of (B, context_length + 1) windows."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as L
import torch
from tokenizers import Tokenizer
from torch.utils.data import DataLoader

from lm_systems.data.corpus import resolve_corpus
from lm_systems.data.preparation import CorpusPreparation, PreparedData
from lm_systems.data.synthetic import SyntheticTrainStream, SyntheticValidation
from lm_systems.data.token_cache import TokenSplits
from lm_systems.data.tokenizer import END_OF_TEXT
from lm_systems.data.windows import TrainWindowStream, ValidationWindows, validation_window_starts
from lm_systems.errors import InputError


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
        self.target_vocab_size = vocab_size
        self.context_length = context_length
        self.batch_size = batch_size
        self.val_batches = val_batches
        self.num_workers = num_workers
        self.seed = seed
        self.synthetic = synthetic
        # The corpus is resolved now so a typo fails before any model is built; nothing is read yet. Its settings
        # (tokenizer, column, validation share, processes) are the preparation's alone.
        cache_dir = Path(cache_dir)
        self._preparation = (
            None
            if synthetic
            else CorpusPreparation(
                corpus,
                resolve_corpus(corpus, cache_dir, generated_stories, seed),
                cache_dir,
                text_column,
                val_fraction,
                num_proc,
                tokenizer,
                vocab_size,
            )
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
        """The tokenizer and token cache, prepared once per process (``lm_systems.data.preparation``)."""
        if self._prepared is None:
            if self._preparation is None:
                raise RuntimeError("synthetic data (--data.synthetic true) has no corpus, tokenizer or token cache")
            self._prepared = self._preparation.run()
        return self._prepared
