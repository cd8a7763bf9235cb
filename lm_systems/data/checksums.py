"""Checksums of the cache's files: computed from the bytes as they are written, checked whole before a file is used.

A record is ``{"bytes": N, "block_bytes": B, "crc32": [one per block of B bytes]}``: every byte of the file is
covered, and a damaged file is named by the first block that differs. Checking reads the whole file (CRC-32
runs at about 2 GB/s on one core). Files written here whose record is not kept elsewhere (the generated corpus,
trained tokenizers) carry it in a sidecar, ``<name>.check.json``, written after the file: a file without one (a
crash between the two) is untrusted too.
"""

from __future__ import annotations

import contextlib
import json
import zlib
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Optional

from lm_systems.files.atomic_files import atomic_write_path, write_json_atomic

BLOCK_BYTES = 16 << 20
SIDECAR_SUFFIX = ".check.json"


class BlockChecksum:
    """CRC-32 of each ``block_bytes`` block of a byte stream, fed in order with ``update``."""

    def __init__(self, block_bytes: int = BLOCK_BYTES) -> None:
        self.block_bytes = block_bytes
        self.size = 0
        self._crcs: list[int] = []
        self._crc = 0

    def update(self, data: Any) -> None:
        """Add the next bytes of the stream (any buffer: bytes, a contiguous array)."""
        view = memoryview(data).cast("B")
        while len(view):
            room = self.block_bytes - self.size % self.block_bytes
            piece, view = view[:room], view[room:]
            self._crc = zlib.crc32(piece, self._crc)
            self.size += len(piece)
            if self.size % self.block_bytes == 0:
                self._crcs.append(self._crc)
                self._crc = 0

    def record(self) -> dict[str, Any]:
        partial = [self._crc] if self.size % self.block_bytes else []
        return {
            "bytes": self.size,
            "block_bytes": self.block_bytes,
            "crc32": [f"{crc:08x}" for crc in self._crcs + partial],
        }


def damage(path: Path, record: Any) -> Optional[str]:
    """What is wrong with ``path`` against its ``record`` (as written), or None when every block matches."""
    if not isinstance(record, dict) or not {"bytes", "block_bytes", "crc32"} <= record.keys():
        return f"no checksum of {str(path)!r} was recorded (written by an older version, or unfinished)"
    if not path.is_file():
        return f"{str(path)!r} is missing"
    size = path.stat().st_size
    if size != record["bytes"]:
        return f"{str(path)!r} has {size} bytes, {record['bytes']} were written"
    block = record["block_bytes"]
    with open(path, "rb") as file:
        for index, expected in enumerate(record["crc32"]):
            if f"{zlib.crc32(file.read(block)):08x}" != expected:
                return f"{str(path)!r} differs from what was written in bytes {index * block}–{(index + 1) * block}"
    return None


def sidecar(path: Path) -> Path:
    return path.with_name(path.name + SIDECAR_SUFFIX)


def sidecar_damage(path: Path) -> Optional[str]:
    """``damage`` against the record in ``path``'s sidecar (a missing or unreadable sidecar is damage too)."""
    try:
        record = json.loads(sidecar(path).read_text())
    except (OSError, ValueError):
        record = None
    return damage(path, record)


class _ChecksummedFile:
    def __init__(self, file: BinaryIO, checksum: BlockChecksum) -> None:
        self._file, self._checksum = file, checksum

    def write(self, data: bytes) -> int:
        self._checksum.update(data)
        return self._file.write(data)


@contextlib.contextmanager
def checked_writer(path: str | Path) -> Iterator[_ChecksummedFile]:
    """A binary file to write ``path`` through: atomically, then its sidecar record of exactly the bytes written."""
    path, checksum = Path(path), BlockChecksum()
    sidecar(path).unlink(missing_ok=True)  # the old record describes the old file
    with atomic_write_path(path) as tmp, open(tmp, "wb") as file:
        yield _ChecksummedFile(file, checksum)
    write_json_atomic(sidecar(path), checksum.record())


def record_written_file(path: str | Path) -> None:
    """Write the sidecar record of ``path`` as it is now: for a file another library has just written whole."""
    path, checksum = Path(path), BlockChecksum()
    with open(path, "rb") as file:
        while chunk := file.read(BLOCK_BYTES):
            checksum.update(chunk)
    write_json_atomic(sidecar(path), checksum.record())


def write_checked_json(path: str | Path, value: Any) -> None:
    """``value`` as JSON at ``path``, with its sidecar record."""
    with checked_writer(path) as file:
        file.write(json.dumps(value, indent=2, sort_keys=True).encode())
