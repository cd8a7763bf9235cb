"""IntervalCheckpoint: save every N optimizer steps, always at the end, and on a crash where it is safe."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn


class IntervalCheckpoint(Callback):
    """Writes ``step=N.ckpt`` every ``interval`` steps (> 0) and at the end, plus ``last.ckpt`` each time.

    ``interval <= 0`` saves only at the end. The final step is always saved. On an exception in a
    single-process run, the state is saved as ``crash.ckpt`` (resume it with ``--ckpt_path``); in a
    distributed run that save would wait on ranks that may be gone, so it is skipped.
    """

    def __init__(self, interval: int = 0, dirpath: Optional[str] = None) -> None:
        self.interval = interval
        self.dirpath = dirpath
        self._last_saved_step = -1

    def _dir(self, trainer: "L.Trainer") -> Path:
        if self.dirpath is not None:
            return Path(self.dirpath)
        log_dir = trainer.logger.log_dir if trainer.logger is not None else trainer.default_root_dir
        return Path(log_dir) / "checkpoints"

    def _save(self, trainer: "L.Trainer", name: str) -> None:
        path = self._dir(trainer) / name
        trainer.save_checkpoint(path)  # a collective: every rank calls it, rank 0 writes
        if trainer.is_global_zero:
            shutil.copyfile(path, path.with_name("last.ckpt"))
        self._last_saved_step = trainer.global_step
        rank_zero_info(f"checkpoint saved: {path}")

    def on_train_batch_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule", *args: Any) -> None:
        step = trainer.global_step
        if self.interval > 0 and step > 0 and step % self.interval == 0 and step != self._last_saved_step:
            self._save(trainer, f"step={step}.ckpt")

    def on_train_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        if trainer.global_step != self._last_saved_step:
            self._save(trainer, f"step={trainer.global_step}.ckpt")

    def on_exception(self, trainer: "L.Trainer", pl_module: "L.LightningModule", exception: BaseException) -> None:
        if trainer.world_size > 1 or trainer.global_step == 0:
            return
        try:
            self._save(trainer, "crash.ckpt")
        except Exception as error:  # the original exception is the one to surface
            rank_zero_warn(f"could not save crash.ckpt after {type(exception).__name__}: {error}")

    def state_dict(self) -> dict[str, Any]:
        return {"last_saved_step": self._last_saved_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_saved_step = state_dict.get("last_saved_step", -1)
