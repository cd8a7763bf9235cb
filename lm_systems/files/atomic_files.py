"""Files written whole or not at all: a temporary name beside the target, renamed over it once complete.

The checkpoints, the data caches and the ``--help`` cache all write through here, so that a crash, a kill or a
full disk mid-write never leaves a torn file that a later run would trust.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Iterable, Iterator

from lm_systems.errors import os_error_in

TEMPORARY_NAME = re.compile(r"\.tmp-(?P<pid>\d+)-[0-9a-f]{8}$")
"""The suffix ``atomic_write_path`` gives a file while it is written: the writer's process id and a random tag."""
ABANDONED_AFTER_S = 60
"""A temporary file untouched this long whose writer is not running here is a killed write's. The age guards a
folder shared between machines, where another host's writer has a process id unknown here."""


@contextlib.contextmanager
def atomic_write_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it onto ``path`` only if the block succeeds.

    A crash (or Ctrl-C) mid-write leaves a ``*.tmp-*`` file that nothing reads, never a half-written
    ``path`` that a later run would trust. The rename is atomic on POSIX within one filesystem. An OSError
    that names no file is raised again naming ``path`` (``write_errors_named``).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with write_errors_named(path):
            yield tmp
            os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


@contextlib.contextmanager
def write_errors_named(path: str | os.PathLike) -> Iterator[None]:
    """An OSError raised in the block without a file's name (pyarrow's on a full disk; torch.save raises a
    RuntimeError while handling one) is raised again naming ``path``, whose filesystem's free space is then the one
    reported (:func:`lm_systems.errors.write_error_message`)."""
    try:
        yield
    except (OSError, RuntimeError) as error:
        cause = os_error_in(error)
        if cause is None or cause.filename is not None:
            raise
        raise OSError(cause.errno, cause.strerror or str(cause), str(path)) from error


def remove_abandoned_temporaries(paths: Iterable[Path]) -> list[Path]:
    """Delete those of ``paths`` that are temporaries of a killed writer (a kill -9 mid-save leaves one for ever):
    ``atomic_write_path``'s files, or a checkpoint directory's (``lm_systems.files.checkpoint_dir``, named the same
    way after its rank 0); the ones deleted."""
    removed = []
    for path in paths:
        match = TEMPORARY_NAME.search(path.name)
        if match is None or _running(int(match["pid"])):
            continue
        try:
            if time.time() - path.stat().st_mtime > ABANDONED_AFTER_S:
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()
                removed.append(path)
        except FileNotFoundError:  # renamed into place or removed meanwhile
            continue
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def write_json_atomic(path: str | os.PathLike, value: Any) -> None:
    with atomic_write_path(path) as tmp:
        tmp.write_text(json.dumps(value, indent=2, sort_keys=True))


def link_atomically(target: str | os.PathLike, link: str | os.PathLike) -> None:
    """Point ``link`` at ``target`` (a relative symlink) by renaming a new link over it: never absent, never torn.

    Where symlinks are not allowed (Windows without the privilege), a hard link is renamed over it instead;
    neither copies the file.
    """
    target, link = Path(target), Path(link)
    with atomic_write_path(link) as tmp:
        try:
            os.symlink(os.path.relpath(target, link.parent), tmp)
        except OSError:
            os.link(target, tmp)
