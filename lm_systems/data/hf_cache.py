"""The Arrow files `datasets` writes under ``<cache_dir>/hf``, checked like every other file of the cache.

`datasets` trusts its prepared Arrow files as they are: overwritten bytes were read as text (a tokenizer trained
on damaged stories, then cached with a valid checksum of its own), a truncated file failed every later run in
pyarrow. Each Arrow file gets a checksum sidecar (:mod:`lm_systems.data.checksums`) right after `datasets` has
prepared it; before the next load, a file whose bytes differ from its record, or that has no record, is named and
its prepared folder removed, so that `datasets` prepares it again from the source (a local file, or the Hub
download it keeps beside it).
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Callable, TypeVar

from lm_systems.data.checksums import record_written_file, sidecar_damage

Loaded = TypeVar("Loaded")


def checked_load(hf_cache: str | Path, load: Callable[[], Loaded]) -> Loaded:
    """``load()`` (a `datasets` load writing under ``hf_cache``), after removing the damaged prepared folders there
    and before recording the Arrow files it prepared. Run under the data cache's lock."""
    hf_cache = Path(hf_cache)
    _remove_damaged(hf_cache)
    before = _arrow_files(hf_cache)
    loaded = load()
    for path, stamp in _arrow_files(hf_cache).items():
        if before.get(path) != stamp:
            record_written_file(path)
    return loaded


def _arrow_files(hf_cache: Path) -> dict[Path, tuple[int, int]]:
    """Each prepared Arrow file under ``hf_cache`` with its size and modification time."""
    files = {}
    for path in hf_cache.rglob("*.arrow"):
        if path.is_file():
            status = path.stat()
            files[path] = (status.st_size, status.st_mtime_ns)
    return files


def _remove_damaged(hf_cache: Path) -> None:
    for path in _arrow_files(hf_cache):
        if not path.exists():  # its folder went with an earlier damaged file
            continue
        problem = sidecar_damage(path)
        if problem is not None:
            warnings.warn(
                f"the datasets cache is damaged: {problem}; preparing {str(path.parent)!r} again from the corpus",
                stacklevel=3,
            )
            shutil.rmtree(path.parent)
