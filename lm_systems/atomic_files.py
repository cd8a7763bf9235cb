"""Files written whole or not at all: a temporary name beside the target, renamed over it once complete.

The checkpoints, the data caches and the ``--help`` cache all write through here, so that a crash, a kill or a
full disk mid-write never leaves a torn file that a later run would trust, and a Ctrl-C waits for the write to end.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import uuid
from pathlib import Path
from typing import Any, Iterator

from lm_systems.errors import os_error_in


@contextlib.contextmanager
def atomic_write_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it onto ``path`` only if the block succeeds.

    A crash (or Ctrl-C) mid-write leaves a ``*.tmp-*`` file that nothing reads, never a half-written
    ``path`` that a later run would trust. The rename is atomic on POSIX within one filesystem. An OSError
    (a full disk: torch.save raises a RuntimeError while handling it) is raised again naming ``path``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    with ctrl_c_held():
        try:
            yield tmp
            os.replace(tmp, path)
        except (OSError, RuntimeError) as error:
            cause = os_error_in(error)
            if cause is None or cause.filename is not None:
                raise
            raise OSError(cause.errno, cause.strerror, str(path)) from error
        finally:
            if tmp.exists():
                tmp.unlink()


@contextlib.contextmanager
def ctrl_c_held() -> Iterator[None]:
    """Hold a Ctrl-C that arrives in the block until the block has ended, then raise it; a second one raises at once.

    ``torch.save`` turns a KeyboardInterrupt raised mid-write into a RuntimeError of its zip writer, which hid the
    Ctrl-C (exit 1 and a traceback instead of 130) and lost the file being written. Held, the write completes and
    the interrupt is raised after it. Only the main thread receives signals; elsewhere the block runs as it is.
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
