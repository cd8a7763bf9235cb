"""Room on disk for a checkpoint, checked before it is written: a full disk is refused in one line naming the bytes
needed and free, not found mid-write."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.distributed.tensor import DTensor

from lm_systems.errors import RunError


def tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (nested dicts, lists, tuples), each storage once; of a DTensor, this rank's
    rows."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for tensor in _tensors(value):
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        key = (local.untyped_storage().data_ptr(), local.storage_offset()) if local.numel() else (id(local), 0)
        if key not in seen:
            seen.add(key)
            total += local.numel() * local.element_size()
    return total


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes on the filesystem that holds ``path`` (or its nearest existing parent)."""
    path = Path(path).absolute()
    folder = next(folder for folder in (path, *path.parents) if folder.is_dir())
    return shutil.disk_usage(folder).free


def require_space(path: str | os.PathLike, needed: int) -> None:
    """A one-line RunError if ``path``'s filesystem has fewer than ``needed`` bytes free."""
    free = free_bytes(Path(path).parent)
    if needed > free:
        raise RunError(no_space_message(path, needed, free))


def no_space_message(path: str | os.PathLike, needed: int, free: int) -> str:
    return (
        f"cannot write checkpoint {str(path)!r}: it needs {needed:,} bytes and its filesystem has {free:,} free; free "
        "some space, save less often (--checkpointing_interval), keep fewer (--checkpointing_keep) or write elsewhere "
        "(--trainer.default_root_dir)"
    )


def no_room_message(folder: str | os.PathLike, needed: int, free: int) -> str:
    return (
        f"checkpoints of this run need {needed:,} bytes each and the filesystem of {str(folder)!r} has {free:,} free: "
        "its first save would fail; free some space, write elsewhere (--trainer.default_root_dir) or train without "
        "checkpoints (--trainer.enable_checkpointing false)"
    )


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
