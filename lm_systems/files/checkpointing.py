"""What the run's checkpoint callbacks (:mod:`lm_systems.run_callbacks.checkpoints`) share with the strategies and
with resuming: the crash checkpoint's file name, and how a strategy that writes in the background says when a
checkpoint is whole."""

from __future__ import annotations

from typing import Callable

CRASH_CHECKPOINT = "crash.ckpt"
"""The file ``CrashCheckpoint`` writes beside the run's other checkpoints when a single-process fit stops."""


class PublishedCheckpoints:
    """A strategy whose checkpoints may become whole after ``save_checkpoint`` returns (written in the background):
    ``when_published(path, action)`` runs ``action`` once ``path`` is whole under its own name, at once if it is."""

    def when_published(self, path: str, action: Callable[[], None]) -> None:
        action()
