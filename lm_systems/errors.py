"""How a failed command ends: one ``error: ...`` line on stderr saying what to change, and an exit status.

``InputError``: input the user can fix; ``RunError``: a run that stopped for a reason its message explains; a file
that cannot be written is named with its filesystem's free space. Any other exception is a bug and keeps its
traceback; ``--debug`` (or ``LM_SYSTEMS_DEBUG=1``) keeps every one. Exit statuses: 2 bad input (as for a mistyped
flag), 1 a stopped run or an unwritable file, 130 Ctrl-C, 143 SIGTERM (after ``crash.ckpt``).
"""

from __future__ import annotations

import ast
import contextlib
import errno
import os
import re
import shutil
import signal
import sys
import threading
from pathlib import Path
from typing import Iterator, Optional

DEBUG_ENV = "LM_SYSTEMS_DEBUG"
FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
WRITE_ERRNOS = {*FULL_ERRNOS, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST, errno.EISDIR}
"""An OSError with one of these, raised while writing, is the environment's problem: named in one line."""


class InputError(ValueError):
    """Input the user can fix: the message names the flag or key, the value and what to change."""


class RunError(RuntimeError):
    """A run stopped for a reason its message explains (and says what to change)."""

    resume_advice: Optional[str] = None
    """Set where the weights were whole when the run stopped, so that a crash checkpoint of them is worth writing:
    what to change when resuming from it (the same settings would stop the same way)."""


def debug_requested() -> bool:
    return os.environ.get(DEBUG_ENV, "").lower() not in ("", "0", "false", "no")


def request_debug() -> None:
    """Keep tracebacks, here and in processes this one starts (the variable is inherited)."""
    os.environ[DEBUG_ENV] = "1"


def os_error_in(error: BaseException) -> Optional[OSError]:
    """The first OSError in ``error``'s chain (itself, its cause or the exception it interrupted), if any: torch.save
    on a full disk raises a RuntimeError ("enforce fail at inline_container.cc") handling the one that says why."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def free_space(path: str | Path) -> str:
    """Free space on the filesystem holding ``path`` (or its nearest existing parent), e.g. ``'1.2 GB free'``."""
    path = Path(path).absolute()
    for folder in (path, *path.parents):
        if folder.is_dir():
            free = shutil.disk_usage(folder).free
            for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
                if free >= size:
                    return f"{free / size:.1f} {unit} free"
            return f"{free} bytes free"
    return "free space unknown"


def write_error_message(error: OSError) -> str:
    where = f"{str(error.filename)!r}" if error.filename else "a file"
    full = error.errno in FULL_ERRNOS
    return (
        f"cannot write {where}: {error.strerror or error} ({free_space(error.filename or '.')} on its filesystem); "
        f"{'free some space or ' if full else ''}write elsewhere: --trainer.default_root_dir for logs and "
        "checkpoints, --data.cache_dir for the data cache"
    )


def one_line(text: str) -> str:
    """``text`` as one line. Of jsonargparse's dump of a value no Union subtype took (type, value and every subtype's
    error) the errors that explain are kept: not "Expected a <class 'str'>" for a strategy given as a class. A value
    outside a Literal's choices reads ``--key 'value' is not one of: a, b``."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    given = next((line.split(": ", 1)[1] for line in lines if line.startswith("Given value: ")), None)
    if any(line.startswith("Does not validate against any of the Union subtypes") for line in lines):
        errors = [line[2:] for line in lines if line.startswith("- ")]
        telling = [error for error in errors if not error.startswith(_UNTELLING)]
        lines = [line for line in lines if line.startswith("Parser key")] + (telling or errors)
    expected = lines[1:]
    if len(expected) == 1 and ". Got value: " in expected[0]:
        expected[0], given = expected[0].split(". Got value: ", 1)
    choices = [_LITERAL.fullmatch(error) for error in expected]
    if choices and all(choices) and given is not None and lines[0].startswith('Parser key "'):
        key = lines[0].split('"')[1]
        names = [str(name) for match in choices for name in ast.literal_eval(f"[{match.group(1)}]")]
        return f"--{key} {given!r} is not one of: {', '.join(names)}"
    return " ".join(lines)


_UNTELLING = ("Expected a <class", "Expected a dot import path", "Not a valid subclass", "Import path")
_LITERAL = re.compile(r"Expected a typing\.Literal\[(.*)\]")


def _exit(message: str, status: int, error: BaseException) -> None:
    if debug_requested():
        raise error
    print(f"error: {one_line(message)}", file=sys.stderr, flush=True)
    raise SystemExit(status) from error


@contextlib.contextmanager
def reported_errors() -> Iterator[None]:
    """Run the block; known errors end the process with one line and their exit status (see the module doc)."""
    interrupted = []
    previous = signal.getsignal(signal.SIGINT)

    def on_sigint(signum, frame):  # Lightning turns Ctrl-C into exit(1); this tells that exit apart
        interrupted.append(signum)
        signal.default_int_handler(signum, frame)

    if previous is signal.default_int_handler and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    except SystemExit as done:
        from lightning.pytorch.utilities.exceptions import SIGTERMException  # a SystemExit, of status 0

        if isinstance(done, SIGTERMException):
            raise SystemExit(128 + signal.SIGTERM) from done
        # Lightning exits 1 on a KeyboardInterrupt: raised by Ctrl-C's handler, or by the ranks' agreement to stop
        if (interrupted or isinstance(done.__context__, KeyboardInterrupt)) and done.code not in (0, None):
            raise SystemExit(128 + signal.SIGINT) from done
        raise
    except KeyboardInterrupt as stop:
        _exit("interrupted (Ctrl-C)", 128 + signal.SIGINT, stop)
    except InputError as error:
        _exit(str(error), 2, error)
    except RunError as error:
        _exit(str(error), 1, error)
    except BaseException as error:
        cause = os_error_in(error)
        if cause is None or cause.errno not in WRITE_ERRNOS:
            raise
        _exit(write_error_message(cause), 1, error)
    finally:
        if signal.getsignal(signal.SIGINT) is on_sigint:
            signal.signal(signal.SIGINT, previous)
