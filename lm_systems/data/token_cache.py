"""Token memmaps: a corpus tokenised once into ``train.npy`` / ``validation.npy``, cached under a content key.

The entry's folder is named by a hash of (corpus identity, tokenizer fingerprint, text column,
validation fraction), so a different corpus or tokenizer gets a new entry and an unchanged one is
reused. ``meta.json`` is written last and atomically, with its own checksum: an entry without it (a crash
mid-way) is rebuilt, never trusted. It records each file's size and a CRC-32 of every block, computed while
the file was written (:mod:`lm_systems.data.checksums`); an entry whose meta.json or files disagree
(truncated, overwritten, edited) is reported by path and rebuilt.
"""

from __future__ import annotations

import json
import math
import shutil
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
from tokenizers import Tokenizer

from lm_systems.data.checksums import BlockChecksum, damage, sidecar, sidecar_damage, write_checked_json
from lm_systems.data.corpus import CorpusSource
from lm_systems.data.tokenizer import END_OF_TEXT, tokenizer_fingerprint
from lm_systems.errors import InputError
from lm_systems.files.atomic_files import atomic_write_path, write_errors_named
from lm_systems.files.fingerprint import fingerprint

if TYPE_CHECKING:  # `datasets` is imported where a cache is built: `train.py --help` does without it
    from datasets import Dataset, DatasetDict

META_FILE = "meta.json"
SPLITS = ("train", "validation")


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type that holds every id: uint16 up to 65,536 tokens, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32)


@dataclass(frozen=True)
class TokenSplits:
    """A complete cache entry: one ``.npy`` of token ids per split, and what ``meta.json`` recorded."""

    directory: Path
    meta: dict[str, Any]

    def path(self, split: str) -> Path:
        return self.directory / f"{split}.npy"

    def tokens(self, split: str) -> np.ndarray:
        """The split's ids as a read-only memmap (nothing is read until indexed)."""
        return np.load(self.path(split), mmap_mode="r")


def token_cache_entry(
    cache_dir: str | Path, source: CorpusSource, tokenizer: Tokenizer, text_column: str, val_fraction: float
) -> Path:
    """The folder of the entry for this corpus, tokenizer and split settings (complete or not)."""
    key = fingerprint(
        {
            "corpus": source.identity,
            "tokenizer": tokenizer_fingerprint(tokenizer),
            "text_column": text_column,
            "val_fraction": val_fraction,
        }
    )
    return Path(cache_dir) / "tokens" / key


def token_cache_damage(splits: TokenSplits) -> str | None:
    """What is wrong with a completed entry's files, or None when they match what meta.json recorded."""
    recorded = splits.meta.get("files")
    if not isinstance(recorded, dict):
        return "its meta.json records no checksums (written by an older version)"
    for name in SPLITS:
        problem = damage(splits.path(name), recorded.get(name))
        if problem is not None:
            return problem
    return None


def open_token_cache(directory: Path) -> TokenSplits | None:
    """The entry in ``directory`` if it was completed (its meta.json exists) and its files are intact, else None.

    A damaged entry is reported with a warning naming the file; returning None has it rebuilt.
    """
    meta_path = directory / META_FILE
    if not meta_path.is_file():
        return None
    problem = sidecar_damage(meta_path)
    if problem is None:
        splits = TokenSplits(directory, json.loads(meta_path.read_text()))
        problem = token_cache_damage(splits)
    if problem is not None:
        warnings.warn(f"token cache entry {str(directory)!r} is damaged: {problem}; rebuilding it", stacklevel=2)
        return None
    return splits


def build_token_cache(
    directory: Path,
    corpus: DatasetDict,
    source: CorpusSource,
    tokenizer: Tokenizer,
    val_fraction: float,
    num_proc: int | None,
) -> TokenSplits:
    """Tokenise every split of ``corpus`` into ``directory``; without a validation split, hold out its tail.

    Documents are followed by ``<|endoftext|>``; a stream source (.txt lines) is concatenated as it is.
    `datasets.map` runs the tokenizer in batches (``num_proc`` processes, None: one process whose Rust
    encoder already uses every core) and shows a progress bar. Run under the cache lock (``cache_lock``): the
    work folders of builds that were killed are removed first.
    """
    import pyarrow.compute as pc

    start = time.perf_counter()
    (directory / META_FILE).unlink(missing_ok=True)  # a damaged entry stays untrusted until rebuilt whole
    sidecar(directory / META_FILE).unlink(missing_ok=True)
    for abandoned in directory.glob("work-*"):  # a killed build's: builds run one at a time, under the cache lock
        shutil.rmtree(abandoned, ignore_errors=True)
    eot_id = tokenizer.token_to_id(END_OF_TEXT)
    dtype = token_dtype(tokenizer.get_vocab_size())
    work = directory / f"work-{uuid.uuid4().hex[:8]}"  # datasets' map output; removed once the .npy files exist
    try:
        encoded = {}
        for name, split in corpus.items():
            arrow = work / f"{name}.arrow"
            with write_errors_named(arrow):
                encoded[name] = _encode(split, tokenizer, eot_id, source.is_stream, dtype, num_proc, arrow)
        counts = {name: pc.sum(split.data.column("num_tokens")).as_py() or 0 for name, split in encoded.items()}
        if not any(counts.values()):
            raise InputError(f"--data.corpus {source.spec!r} has no text: tokenising it gave no tokens")
        # With a document per row, every row adds an <|endoftext|> id after its own tokens.
        lengths = {name: counts[name] + (0 if source.is_stream else encoded[name].num_rows) for name in encoded}
        if "validation" in encoded:
            sizes = dict(lengths)
            records = {}
            for name in SPLITS:
                records |= _write_splits(_token_chunks(encoded[name]), {name: sizes[name]}, directory, dtype)
            held_out = "the corpus' own validation split"
        else:
            total = lengths["train"]
            validation = max(1, math.ceil(total * val_fraction))
            sizes = {"train": total - validation, "validation": validation}
            records = _write_splits(_token_chunks(encoded["train"]), sizes, directory, dtype)
            held_out = f"the last {val_fraction:.1%} of the token stream"
    finally:
        shutil.rmtree(work, ignore_errors=True)
    meta = {
        "corpus": source.spec,
        "identity": source.identity,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "vocab_size": tokenizer.get_vocab_size(),
        "eot_id": eot_id,
        "dtype": dtype.name,
        "tokens": sizes,
        "rows": {name: split.num_rows for name, split in encoded.items()},
        "files": records,
        "validation": held_out,
        "seconds": round(time.perf_counter() - start, 2),
    }
    write_checked_json(directory / META_FILE, meta)
    return TokenSplits(directory, meta)


def _encode(
    split: Dataset,
    tokenizer: Tokenizer,
    eot_id: int,
    is_stream: bool,
    dtype: np.dtype,
    num_proc: int | None,
    cache_file: Path,
) -> Dataset:
    from datasets import Features, Sequence, Value

    suffix = [] if is_stream else [eot_id]

    def encode_batch(batch: dict[str, list]) -> dict[str, list]:
        encodings = tokenizer.encode_batch(batch["text"])
        return {"ids": [e.ids + suffix for e in encodings], "num_tokens": [len(e.ids) for e in encodings]}

    cache_file.parent.mkdir(parents=True, exist_ok=True)
    return split.map(
        encode_batch,
        batched=True,
        batch_size=1000,
        remove_columns=split.column_names,
        features=Features({"ids": Sequence(Value(dtype.name)), "num_tokens": Value("int64")}),
        num_proc=num_proc,
        cache_file_name=str(cache_file),
        new_fingerprint=cache_file.parent.name + cache_file.stem,  # skips hashing the tokenizer for datasets' cache
        desc=f"tokenizing {cache_file.stem}",
    )


def _token_chunks(encoded: Dataset, batch_size: int = 10_000) -> Iterator[np.ndarray]:
    """The ids of ``encoded`` in row order, as flat arrays of about ``batch_size`` rows each."""
    for table in encoded.with_format("arrow").iter(batch_size=batch_size):
        yield table.column("ids").combine_chunks().flatten().to_numpy()


def _write_splits(
    chunks: Iterator[np.ndarray], sizes: dict[str, int], directory: Path, dtype: np.dtype
) -> dict[str, dict[str, Any]]:
    """Fill one ``<split>.npy`` per entry of ``sizes``, in order, with consecutive tokens from ``chunks``; the
    checksum record of each file, computed from the bytes as they are written."""
    pending, records = np.empty(0, dtype), {}
    for name, size in sizes.items():
        if size <= 0:
            raise InputError(f"split {name!r} would hold no tokens: change --data.val_fraction")
        checksum = BlockChecksum()
        with atomic_write_path(directory / f"{name}.npy") as tmp:
            out = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(size,))
            with open(tmp, "rb") as file:
                checksum.update(file.read(out.offset))  # the .npy header open_memmap wrote
            filled = 0
            while filled < size:
                if pending.size == 0:
                    pending = next(chunks)
                take = min(size - filled, pending.size)
                piece = np.ascontiguousarray(pending[:take], dtype=dtype)
                out[filled : filled + take] = piece
                checksum.update(piece)
                pending, filled = pending[take:], filled + take
            out.flush()
            del out  # close the memmap before the rename
        records[name] = checksum.record()
    return records
