"""Cache plumbing shared by the data pipeline: file identities, a lock across processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from filelock import FileLock


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
