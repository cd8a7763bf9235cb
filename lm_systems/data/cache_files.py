"""Cache plumbing shared by the data pipeline: atomic writes, fingerprints, a lock across processes."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any, Iterator

from filelock import FileLock

from lm_systems.errors import os_error_in


@contextlib.contextmanager
def atomic_write_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it onto ``path`` only if the block succeeds.

    A crash (or Ctrl-C) mid-write leaves a ``*.tmp-*`` file that nothing reads, never a half-written
    ``path`` that a later run would trust. The rename is atomic on POSIX within one filesystem. An OSError
    (a full disk: torch.save raises a RuntimeError while handling it) is raised again naming ``path``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
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


def write_json_atomic(path: str | Path, value: Any) -> None:
    with atomic_write_path(path) as tmp:
        tmp.write_text(json.dumps(value, indent=2, sort_keys=True))


def fingerprint(value: Any, length: int = 16) -> str:
    """Short stable hash of a JSON-serialisable value (dict keys sorted), used to name cache entries."""
    text = json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def file_identity(path: str | Path) -> dict[str, Any]:
    """What identifies a local file or folder without reading it: absolute path, sizes and mtimes."""
    path = Path(path).resolve()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return {
        "path": str(path),
        "files": [(str(p.relative_to(path.parent)), p.stat().st_size, p.stat().st_mtime_ns) for p in files],
    }


def cache_lock(cache_dir: str | Path) -> FileLock:
    """One lock per cache folder: concurrent ranks or runs build an entry once, the others then reuse it."""
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    return FileLock(str(Path(cache_dir) / ".lock"))
