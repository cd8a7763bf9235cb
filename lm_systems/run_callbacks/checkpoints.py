"""The run's checkpoints: Lightning's ModelCheckpoint, made safe for long runs, and a crash checkpoint.

``StepCheckpoint`` writes ``step=N.ckpt`` every N optimizer steps and at the end of fit, and points
``last.ckpt`` at the newest one; ``CrashCheckpoint`` writes ``crash.ckpt`` when a single-process run
stops on an exception (Ctrl-C, SIGTERM, an error). LitLM refuses to save non-finite weights, and
:mod:`lm_systems.files.checkpoint_io`'s ``SafeCheckpointIO`` writes every file atomically.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Union

import lightning.pytorch as L
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lm_systems.compat.lightning import LinkingModelCheckpoint
from lm_systems.errors import WRITE_ERRNOS, RunError, os_error_in
from lm_systems.files.atomic_files import link_atomically, remove_abandoned_temporaries
from lm_systems.files.checkpointing import CRASH_CHECKPOINT, PublishedCheckpoints
from lm_systems.training.strategy_offers import StoppedTogether


class StepCheckpoint(LinkingModelCheckpoint):
    """ModelCheckpoint keeping ``step=N.ckpt`` every ``every_n_train_steps`` (<= 0: none) and at the end of fit; with
    ``keep`` > 0 only the newest ``keep`` of them.

    ``last.ckpt`` is a link to the newest file, replaced atomically (never a second copy). At setup, the temporary
    files of saves that were killed (kill -9) are removed from the runs beside this one.
    """

    def __init__(self, every_n_train_steps: int = 0, dirpath: Optional[Union[str, Path]] = None, keep: int = 0) -> None:
        super().__init__(
            dirpath=dirpath,
            filename="step={step}",
            auto_insert_metric_name=False,
            # keep > 0: the newest ``keep`` by step (an older one is removed once a newer one is whole)
            save_top_k=keep if keep > 0 else -1,
            monitor="step" if keep > 0 else None,
            mode="max",
            save_last="link",
            every_n_train_steps=max(every_n_train_steps, 0),
            enable_version_counter=False,  # names follow the step: a resumed run rewrites the same step's file
        )

    @property
    @override
    def state_key(self) -> str:
        return type(self).__qualname__  # one per trainer: its state carries over a resume that changes the interval

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # A resumed run writes into a new version folder: the old folder's file bookkeeping does not apply there.
        if state_dict.get("dirpath") == self.dirpath:
            super().load_state_dict(state_dict)

    @override
    def setup(self, trainer: "L.Trainer", pl_module: "L.LightningModule", stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if trainer.is_global_zero and self.dirpath is not None:
            # In a logger's version_N folder, every version's: a killed save's temporary stays in the run it was for.
            folder = Path(self.dirpath)
            in_runs = folder.parent.name.startswith("version_")
            found = folder.parent.parent.glob(f"version_*/{folder.name}/*.tmp-*") if in_runs else folder.glob("*.tmp-*")
            for path in remove_abandoned_temporaries(found):
                rank_zero_info(f"removed {path}, left by a save that was killed")

    @override
    def on_train_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        super().on_train_start(trainer, pl_module)
        self.count_as_saved(trainer)  # resumed: its step is the checkpoint resumed from, not one to write again

    @override
    def on_train_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        self.save_step(trainer)  # the final step, unless it was just saved

    @override
    def link_checkpoint(self, trainer: "L.Trainer", filepath: str, linkpath: str) -> None:
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            strategy = trainer.strategy
            publisher = strategy if isinstance(strategy, PublishedCheckpoints) else PublishedCheckpoints()
            publisher.when_published(filepath, lambda: link_atomically(filepath, linkpath))  # never a partial one
        trainer.strategy.barrier()


class CrashCheckpoint(Checkpoint):
    """Writes ``crash.ckpt`` beside the run's other checkpoints when a fit stops on an exception: in a single-process
    run on any, in a run of several processes on a SIGTERM or Ctrl-C its ranks agreed on (``StoppedTogether``: every
    rank then stops at the same batch, so the save's collectives meet; after any other exception a rank may be gone).

    Lightning's OnExceptionCheckpoint needs its folder before the run has one, and its presence makes
    every ``fit`` without ``ckpt_path`` look for a checkpoint to resume (with two warnings). Skipped
    before the first step, after a RunError that leaves no whole weights (non-finite training, out of memory in the
    optimizer's step) or a failed write (a full disk, an unwritable folder: a save would fail too). A failure to save
    is a warning: the exception that stopped the run is the one to surface. A fit that finishes removes an older
    ``crash.ckpt`` from its folder (the one it resumed from).
    """

    FILENAME = CRASH_CHECKPOINT

    @override
    def on_exception(self, trainer: "L.Trainer", pl_module: "L.LightningModule", exception: BaseException) -> None:
        if trainer.global_step == 0:
            return
        if trainer.world_size > 1 and not _stopped_together(trainer, exception):
            return
        if isinstance(exception, RunError) and exception.resume_advice is None:  # weights not whole, or not finite
            return
        if getattr(os_error_in(exception), "errno", None) in WRITE_ERRNOS:  # a save would meet the same full disk
            return
        path = self._path(trainer)
        if path is None:
            return
        try:
            trainer.save_checkpoint(path, weights_only=False)
        except Exception as error:
            rank_zero_warn(f"could not save {path} after {type(exception).__name__}: {error}")
        else:
            advice = f", {exception.resume_advice}" if isinstance(exception, RunError) else ""
            rank_zero_info(f"stopped at step {trainer.global_step}: resume with --ckpt_path {path}{advice}")

    @override
    def teardown(self, trainer: "L.Trainer", pl_module: "L.LightningModule", stage: str) -> None:
        path = self._path(trainer)
        if stage == "fit" and path is not None:  # teardown hooks run only after a fit that finished
            trainer.strategy.remove_checkpoint(path)

    @staticmethod
    def _path(trainer: "L.Trainer") -> Optional[str]:
        dirpath = getattr(trainer.checkpoint_callback, "dirpath", None)
        return os.path.join(dirpath, CrashCheckpoint.FILENAME) if dirpath else None


def _stopped_together(trainer: "L.Trainer", exception: BaseException) -> bool:
    strategy = trainer.strategy
    return (
        isinstance(exception, (SIGTERMException, KeyboardInterrupt))
        and isinstance(strategy, StoppedTogether)
        and strategy.stopped_together()
    )
