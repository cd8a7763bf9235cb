"""The folders a run writes into, made at the door: one that cannot be made is bad input, named by its flag,
before the data is prepared or the model built (a FileNotFoundError deep in Lightning's logger, otherwise)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from lm_systems.errors import InputError


def make_output_folder(path: Optional[str], flag: str) -> None:
    """Create ``path`` (and its parents) unless it exists; an InputError naming ``flag`` when it cannot be made or
    is not a folder. None (the flag unset) is left alone."""
    if path is None:
        return
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise InputError(f"{flag} {path!r} cannot be made ({reason}): pass a folder you can write to") from error
