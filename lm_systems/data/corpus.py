"""Corpus sources: what ``--data.corpus`` names, how its text is loaded through `datasets`, and its identity.

A corpus is one of:

- ``generated``: the embedded stories of :mod:`lm_systems.data.generated_corpus`, written to the cache;
- a local ``.txt`` file: one continuous text; its lines are tokenised in order with nothing added
  between them, so documents are whatever ``<|endoftext|>`` separates in the file (TinyStories' format);
- a local ``.jsonl`` / ``.json`` / ``.parquet`` file or a folder written by ``Dataset.save_to_disk``:
  one document per row, in the column ``--data.text_column``;
- a Hugging Face Hub name such as ``roneneldan/TinyStories`` (needs the network once): one document per row.

A source's own ``validation`` split is used as is; otherwise the token stream is split by position.
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from lm_systems.data.cache_files import file_identity
from lm_systems.data.generated_corpus import GENERATOR_VERSION, ensure_generated_corpus
from lm_systems.data.hf_cache import checked_load
from lm_systems.errors import InputError
from lm_systems.files.fingerprint import fingerprint

if TYPE_CHECKING:  # `datasets` is imported where a corpus is read: `train.py --help` does without it
    from datasets import Dataset, DatasetDict

GENERATED = "generated"
FILE_LOADERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
VALIDATION_SPLITS = ("validation", "valid", "val")
_HUB_NAME = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


@dataclass(frozen=True)
class CorpusSource:
    """A resolved ``--data.corpus``: its kind, where it lives and what identifies its content for caching."""

    spec: str
    kind: str
    """``generated``, ``text`` (a .txt stream), ``json``, ``parquet``, ``saved`` (save_to_disk folder) or ``hub``."""
    location: str
    """Path of the file or folder, or the hub name."""
    identity: dict[str, Any] = field(hash=False)
    """Changes whenever the content may have changed (path, size and mtime; hub name; generator parameters)."""

    @property
    def is_stream(self) -> bool:
        """True when rows are consecutive pieces of one text (lines of a .txt), not separate documents."""
        return self.kind in ("text", GENERATED)


def resolve_corpus(spec: str, cache_dir: str | Path, generated_stories: int, seed: int) -> CorpusSource:
    """Classify ``spec`` without reading the data; a missing local path raises an error naming --data.corpus."""
    if not spec or not spec.strip():
        raise ValueError("--data.corpus is empty: pass 'generated', a file, a saved dataset folder or a hub name")
    if spec == GENERATED:
        identity = {"generator": GENERATOR_VERSION, "num_stories": generated_stories, "seed": seed}
        path = Path(cache_dir) / "corpora" / f"generated-{fingerprint(identity)}.txt"
        return CorpusSource(spec, GENERATED, str(path), identity)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not any((path / marker).is_file() for marker in ("dataset_dict.json", "state.json")):
            raise ValueError(
                f"--data.corpus {spec!r} is a folder but not one written by Dataset.save_to_disk "
                "(no dataset_dict.json or state.json); pass a .txt/.jsonl/.parquet file or a saved dataset"
            )
        return CorpusSource(spec, "saved", str(path.resolve()), file_identity(path))
    if path.is_file():
        loader = FILE_LOADERS.get(path.suffix.lower())
        if loader is None:
            raise ValueError(
                f"--data.corpus {spec!r} has an unsupported extension {path.suffix!r} "
                f"(use one of {', '.join(FILE_LOADERS)})"
            )
        if path.stat().st_size == 0:
            raise ValueError(f"--data.corpus {spec!r} is empty: it has no rows of text")
        return CorpusSource(spec, loader, str(path.resolve()), file_identity(path))
    if path.suffix.lower() in FILE_LOADERS or spec.startswith(("/", ".", "~")) or not _HUB_NAME.match(spec):
        raise FileNotFoundError(f"--data.corpus {spec!r} does not exist (resolved to {str(path.resolve())!r})")
    return CorpusSource(spec, "hub", spec, {"hub": spec})


def load_corpus(source: CorpusSource, cache_dir: str | Path, text_column: str) -> DatasetDict:
    """The corpus as a DatasetDict with a ``train`` split, and a ``validation`` split when the source has one.

    Every split keeps a single column named ``text``. Arrow files that `datasets` writes go under
    ``cache_dir/hf``, next to the rest of the pipeline's cache, checked like it (:mod:`lm_systems.data.hf_cache`).
    """
    from datasets import DatasetDict, load_dataset, load_from_disk

    hf_cache = str(Path(cache_dir) / "hf")
    if source.kind in ("text", "json"):
        require_utf8(Path(source.location), source.spec)
    if source.kind == GENERATED:
        ensure_generated_corpus(source.location, source.identity["num_stories"], source.identity["seed"])
    if source.kind in (GENERATED, "text"):
        loaded = checked_load(
            hf_cache, lambda: load_dataset("text", data_files=source.location, keep_linebreaks=True, cache_dir=hf_cache)
        )
    elif source.kind in ("json", "parquet"):
        loaded = checked_load(
            hf_cache, lambda: load_dataset(source.kind, data_files=source.location, cache_dir=hf_cache)
        )
    elif source.kind == "saved":
        loaded = load_from_disk(source.location)  # the user's own folder, not this cache's
    else:
        loaded = checked_load(hf_cache, lambda: _load_from_hub(source.location, hf_cache))
    splits = _train_and_validation(loaded if isinstance(loaded, DatasetDict) else DatasetDict(train=loaded), source)
    column = "text" if source.is_stream else text_column
    return DatasetDict({name: _text_only(split, column, source) for name, split in splits.items()})


class LazyCorpus:
    """A source's corpus, read by ``load_corpus`` on the first ``get()`` only: a run whose cache is complete
    never reads it (nor imports `datasets`)."""

    def __init__(self, source: CorpusSource, cache_dir: str | Path, text_column: str) -> None:
        self.source, self.cache_dir, self.text_column = source, cache_dir, text_column
        self._loaded: DatasetDict | None = None

    def get(self) -> DatasetDict:
        if self._loaded is None:
            self._loaded = load_corpus(self.source, self.cache_dir, self.text_column)
        return self._loaded


def iter_texts(dataset: Dataset, max_chars: int, batch_size: int = 1000) -> Iterator[str]:
    """The ``text`` column in order, stopping once ``max_chars`` characters have been yielded."""
    seen = 0
    for batch in dataset.iter(batch_size=batch_size):
        for text in batch["text"]:
            if seen >= max_chars:
                return
            seen += len(text)
            yield text


def require_utf8(path: Path, spec: str, chunk_bytes: int = 1 << 20) -> None:
    """An error naming the file, --data.corpus and the encoding when ``path`` is not UTF-8 text (read in chunks)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as file:
        while True:
            chunk = file.read(chunk_bytes)
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as error:
                raise InputError(
                    f"--data.corpus {spec!r}: {str(path)!r} is not UTF-8 text (byte {offset + error.start} is "
                    f"{chunk[error.start : error.start + 1]!r}); pass a text file in UTF-8 (convert with "
                    "`iconv -f <its encoding> -t UTF-8`), or a .parquet file or saved dataset"
                ) from error
            if not chunk:
                return
            offset += len(chunk)


def _load_from_hub(name: str, hf_cache: str) -> DatasetDict:
    from datasets import load_dataset

    try:
        return load_dataset(name, cache_dir=hf_cache)
    except (ConnectionError, OSError) as error:  # offline: ConnectionError; unknown name: DatasetNotFoundError
        raise ConnectionError(
            f"--data.corpus {name!r} is not a local path and could not be loaded from the Hugging Face Hub "
            f"({type(error).__name__}: {error}). Without network access: on a machine that has it, run "
            f"`datasets.load_dataset({name!r}).save_to_disk('some_folder')`, copy the folder here and pass "
            "--data.corpus some_folder."
        ) from error


def _train_and_validation(splits: DatasetDict, source: CorpusSource) -> DatasetDict:
    from datasets import DatasetDict

    if "train" in splits:
        train = splits["train"]
    elif len(splits) == 1:
        train = next(iter(splits.values()))
    else:
        raise InputError(f"--data.corpus {source.spec!r} has splits {sorted(splits)} but none named 'train'")
    result = DatasetDict(train=train)
    validation = next((name for name in VALIDATION_SPLITS if name in splits), None)
    if validation is not None:
        result["validation"] = splits[validation]
    return result


def _text_only(split: Dataset, column: str, source: CorpusSource) -> Dataset:
    if column not in split.column_names:
        raise InputError(
            f"--data.text_column {column!r} is not a column of --data.corpus {source.spec!r} "
            f"(its columns: {', '.join(split.column_names)})"
        )
    if split.num_rows == 0:
        raise InputError(f"--data.corpus {source.spec!r} is empty: it has no rows of text")
    split = split.select_columns([column])
    return split.rename_column(column, "text") if column != "text" else split
