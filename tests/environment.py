"""Tests leave the process environment as they found it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def environment_kept() -> Iterator[None]:
    """``seed_everything`` writes PL_GLOBAL_SEED / PL_SEED_WORKERS into os.environ, Lightning's launchers the rendezvous
    variables: a later subprocess or spawned rank would inherit them, and results would depend on test order. The
    block's changes to the environment are undone on leaving it; a module- or session-scoped fixture that trains
    wraps its body in it (conftest's ``_restore_environment`` undoes a test's own)."""
    environment = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(environment)
