"""Checkpoint files: written whole (SafeCheckpointIO), and checked whole before they are read; a checkpoint directory
(:mod:`lm_systems.files.checkpoint_dir`) is read as one file's contents where a strategy holds the full state."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import zipfile
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

from lm_systems.compat.lightning import is_local_path
from lm_systems.files.atomic_files import atomic_write_path
from lm_systems.files.checkpoint_dir import is_checkpoint_dir, read_whole
from lm_systems.files.disk_space import require_space, tensor_bytes


class SafeCheckpointIO(TorchCheckpointIO):
    """TorchCheckpointIO that writes to a temporary name, then renames; it reads checkpoint directories too (whole,
    on every rank: what a strategy that holds the full state needs).

    A kill at any moment leaves either the previous file or the new one, whole; a Ctrl-C waits for the write to
    end (``ctrl_c_held``). Lightning's own writer serialises the whole checkpoint into memory first and moves it
    out of the system temp folder (a copy when that is another filesystem); this one streams ``torch.save`` into
    the target folder.
    """

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Union[str, Path], storage_options: Optional[Any] = None
    ) -> None:
        if storage_options is not None or not is_local_path(path):
            super().save_checkpoint(checkpoint, path, storage_options)  # remote stores: Lightning's transaction
            return
        require_space(path, tensor_bytes(checkpoint))
        with ctrl_c_held(), atomic_write_path(path) as tmp, open(tmp, "wb") as file:
            torch.save(checkpoint, file)
            file.flush()
            os.fsync(file.fileno())

    @override
    def load_checkpoint(self, path: Union[str, Path], *args: Any, **kwargs: Any) -> dict[str, Any]:
        if is_checkpoint_dir(path):
            return read_whole(path)
        return super().load_checkpoint(path, *args, **kwargs)


def read_checkpoint(path: Union[str, Path], optimizer: bool = True) -> dict[str, Any]:
    """A checkpoint file's or directory's contents, tensors on the CPU (without ``optimizer``, a directory's optimizer
    state is left unread)."""
    if is_checkpoint_dir(path):
        return read_whole(path, optimizer=optimizer)
    return torch.load(path, map_location="cpu", weights_only=False)


@contextlib.contextmanager
def ctrl_c_held() -> Iterator[None]:
    """Hold a Ctrl-C that arrives in the block until the block has ended, then raise it; a second one raises at once.

    ``torch.save`` turns a KeyboardInterrupt raised mid-write into a RuntimeError of its zip writer, which hid the
    Ctrl-C (exit 1 and a traceback instead of 130) and lost the checkpoint being written. Held, the write completes
    and the interrupt is raised after it. Only the main thread receives signals; elsewhere the block runs as it is.
    """
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield
        return
    held = []

    def hold(signum, frame):
        if held:  # pressed again: the user means now
            previous(signum, frame)
        held.append((signum, frame))

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        previous(*held[0])


NEWEST = "last"
"""``--ckpt last`` (generate) and ``--ckpt_path last`` (train.py): the newest ``last.ckpt`` among the runs."""
RUN_CHECKPOINTS = "logs/*/version_*/checkpoints/last.ckpt"
"""Where train.py's runs keep their ``last.ckpt``, relative to the folder it ran in (or its default_root_dir)."""


def newest_run_checkpoint(root: str | Path = ".", flag: str = "--ckpt") -> Path:
    """The ``last.ckpt`` written most recently among ``root``'s runs (``RUN_CHECKPOINTS``); an error naming ``flag``
    if there is none."""
    found = [path for path in Path(root).glob(RUN_CHECKPOINTS) if path.exists()]  # exists: the link's file too
    if not found:
        raise FileNotFoundError(
            f"{flag} {NEWEST}: no run checkpoint ({RUN_CHECKPOINTS}) under {str(Path(root).absolute())!r}: run this "
            "from the folder train.py ran in, or pass a checkpoint's path"
        )
    return max(found, key=lambda path: path.stat().st_mtime)


def require_checkpoint_file(path: str | Path, flag: str) -> Path:
    """``path`` as a Path if it holds a whole PyTorch checkpoint, a file or a checkpoint directory; otherwise an error
    naming ``flag``.

    Reads only the zip's central directory (at the file's end), or a directory's metadata's presence, so a truncated
    or foreign file is found without loading the checkpoint.
    """
    path = Path(path)
    if is_checkpoint_dir(path):
        return path
    if path.is_dir():
        raise IsADirectoryError(
            f"{flag} {str(path)!r} is a folder, not a checkpoint file nor a checkpoint directory (which holds "
            f".metadata and meta.pt): pass e.g. {str(path / 'last.ckpt')!r}"
        )
    if not path.exists():
        raise FileNotFoundError(f"{flag} {str(path)!r} does not exist")
    if not os.access(path, os.R_OK):
        raise PermissionError(f"{flag} {str(path)!r} cannot be read (permission denied)")
    try:
        with zipfile.ZipFile(path) as archive:
            complete = any(name.endswith("/data.pkl") or name == "data.pkl" for name in archive.namelist())
    except (zipfile.BadZipFile, OSError):
        complete = False
    if not complete:
        raise ValueError(
            f"{flag} {str(path)!r} is not a readable PyTorch checkpoint (truncated, or not written by torch.save)"
        )
    return path
