"""``python train.py --help`` without importing Lightning: the help text, cached per source tree and environment.

Importing Lightning (torch, torch._dynamo, torchmetrics) takes most of the time ``--help`` takes, and the text depends
only on the project's sources, the versions of the libraries that render it and the terminal width: after one slow
``--help`` it is printed from ``$XDG_CACHE_HOME/lm_systems/help`` (``~/.cache`` by default; always safe to delete),
keyed by all of those.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import sys
from importlib import metadata
from pathlib import Path
from typing import Callable, Sequence

from lm_systems.files.atomic_files import atomic_write_path

HELP_FLAGS = ("--help", "-h")
SUBCOMMANDS = ("fit", "validate")
NOT_OFFERED = ("test", "predict")  # Lightning's, with nothing to run here: no test split, no predict_step
# What builds the parser: its classes' signatures and docstrings, and the libraries that render them.
SOURCE_DIRS = ("lm_systems", "strategies", "callbacks")
LIBRARIES = ("lightning", "jsonargparse", "torch", "docstring_parser", "typeshed_client")
ROOT = Path(__file__).resolve().parents[2]


def is_help_request(args: Sequence[str]) -> bool:
    """``--help`` or ``-h``, alone or after a subcommand (``fit --help``)."""
    rest = list(args[1:]) if args and args[0] in SUBCOMMANDS else list(args)
    return len(rest) == 1 and rest[0] in HELP_FLAGS


def cache_key(args: Sequence[str], root: Path = ROOT) -> str:
    digest = hashlib.sha256()
    for part in (sys.version, *args, str(shutil.get_terminal_size().columns)):
        digest.update(part.encode() + b"\0")
    for library in LIBRARIES:
        try:
            digest.update(f"{library}={metadata.version(library)}".encode() + b"\0")
        except metadata.PackageNotFoundError:
            digest.update(f"{library}=absent".encode() + b"\0")
    for name, value in sorted(os.environ.items()):
        if name.startswith(("JSONARGPARSE", "LM_SYSTEMS")):
            digest.update(f"{name}={value}".encode() + b"\0")
    sources = [root / "train.py", *sorted(p for d in SOURCE_DIRS for p in (root / d).rglob("*.py"))]
    for path in sources:
        if path.is_file():
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:32]


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lm_systems" / "help"


def run_with_help_cache(args: Sequence[str], main: Callable[[], object]) -> None:
    """Run ``main`` (which parses ``sys.argv``); a help request is answered from the cache, else stored there."""
    if not is_help_request(args):
        main()
        return
    path = cache_dir() / f"{cache_key(args)}.txt"
    if path.is_file():
        sys.stdout.write(path.read_text(encoding="utf-8"))
        raise SystemExit(0)
    text = io.StringIO()
    try:
        with contextlib.redirect_stdout(text):
            main()
    except SystemExit as done:
        if done.code in (0, None):
            _store(path, text.getvalue())
        raise
    finally:
        sys.stdout.write(text.getvalue())


def _store(path: Path, text: str) -> None:
    try:  # a cache that cannot be written is only a slower next --help
        with atomic_write_path(path) as partial:
            partial.write_text(text, encoding="utf-8")
    except OSError:
        pass
