"""TuningCache: the tile configs autotuning chose, kept on disk so that each machine tunes a shape once.

An entry is one JSON file per (kernel, kernel source, Triton version, GPU model and capability, tuning key,
candidate configs): the tuning key holds the shape bucket (next power of two of each sequence length), the
head dim, causality and the dtypes. A change to any of them names another file, so nothing stale is read: a
new Triton, another GPU, an edited kernel or a new candidate list tunes afresh.

Location: ``$LM_SYSTEMS_TUNING_CACHE`` if set (``off`` turns the cache off), else
``$XDG_CACHE_HOME/lm_systems/triton_tuning`` (``~/.cache/lm_systems/triton_tuning``). Entries are written
atomically (a temporary file renamed into place), and tuning one entry holds a file lock, so that two
processes starting together tune it once, not side by side on the same GPU with each other's timings. A
damaged entry is reported, ignored and tuned again. ``python -m lm_systems.attention.tune --clear`` deletes
the folder; see that module for tuning ahead of a run.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import triton
from filelock import FileLock

from lm_systems.atomic_files import write_json_atomic
from lm_systems.fingerprint import fingerprint

CACHE_ENV = "LM_SYSTEMS_TUNING_CACHE"
OFF = ("off", "0", "false", "no")


def default_cache_dir() -> Path | None:
    """Where the tuning cache lives on this machine, or None when ``$LM_SYSTEMS_TUNING_CACHE`` turns it off."""
    chosen = os.environ.get(CACHE_ENV)
    if chosen is not None:
        return None if chosen.strip().lower() in OFF else Path(chosen).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lm_systems" / "triton_tuning"


class TuningCache:
    """Tuned configs on disk under ``root``: ``get`` / ``put`` an entry, ``lock`` it while tuning."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    @staticmethod
    def entry(kernel: str, source: str, device: str, key: tuple, candidates: list[triton.Config]) -> dict[str, Any]:
        """What identifies one tuning: everything a stored choice depends on."""
        return {"kernel": kernel, "source": source, "triton": triton.__version__, "device": device,
                "key": [str(part) for part in key], "candidates": [str(config) for config in candidates]}

    def path(self, entry: dict[str, Any]) -> Path:
        return self.root / f"{entry['kernel']}-{fingerprint(entry, length=24)}.json"

    def lock(self, entry: dict[str, Any]) -> FileLock:
        self.root.mkdir(parents=True, exist_ok=True)
        return FileLock(str(self.path(entry).with_suffix(".lock")))

    def get(self, entry: dict[str, Any], candidates: list[triton.Config]) -> triton.Config | None:
        """The stored choice among ``candidates``, or None when there is none (or it is damaged)."""
        path = self.path(entry)
        try:
            stored = json.loads(path.read_text())
            if stored["entry"] != entry:
                raise ValueError("it belongs to another tuning")
            return candidates[entry["candidates"].index(stored["chosen"])]
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as error:  # ValueError: bad JSON, a choice not a candidate
            warnings.warn(f"ignoring the damaged tuning cache entry {path} ({error}); tuning again", stacklevel=2)
            return None

    def put(self, entry: dict[str, Any], chosen: triton.Config, times_ms: dict[str, float]) -> None:
        """Store ``chosen`` (and every candidate's time, for a person reading the file)."""
        write_json_atomic(self.path(entry), {"entry": entry, "chosen": str(chosen), "times_ms": times_ms})

    def clear(self) -> int:
        """Delete every entry (with the locks and any temporary file a crash left); the number of entries deleted."""
        if not self.root.is_dir():
            return 0
        entries = list(self.root.glob("*.json"))
        for path in [*entries, *self.root.glob("*.lock"), *self.root.glob("*.tmp-*")]:
            path.unlink(missing_ok=True)
        return len(entries)
