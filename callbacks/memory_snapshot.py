"""CUDA allocator history over chosen steps, dumped for pytorch.org/memory_viz, and peak memory per step."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lm_systems.compat.torch import dump_memory_snapshot, record_memory_history

_GIB = 1024**3


class MemorySnapshot(Callback):
    """Records every CUDA allocation over ``num_steps`` steps from ``start_step`` and logs peak memory per step.

    Recording starts at the beginning of optimizer step ``start_step`` and stops after the forward
    pass (``mode="forward"``) or at the end (``mode="step"``) of step ``start_step + num_steps - 1``.
    Each rank then writes ``memory_snapshot_rank{r}_step{s}.pickle`` (``step{s}-{e}`` for several
    steps) into the trainer's log dir: drag it onto https://pytorch.org/memory_viz. Every step logs
    ``memory/peak_forward_gib`` (peak up to the loss) and ``memory/peak_step_gib`` (whole step).
    Without CUDA it warns once and does nothing.
    """

    def __init__(
        self,
        start_step: int = 1,
        num_steps: int = 1,
        mode: Literal["forward", "step"] = "step",
        max_entries: int = 1_000_000,
    ) -> None:
        """``start_step``: first recorded optimizer step (0-based; 1 skips the allocator's first growth);
        ``num_steps``: steps in the recording; ``mode``: "forward" stops after the last step's forward
        pass, "step" after its optimizer step; ``max_entries``: allocation events kept (the ring buffer).
        """
        super().__init__()
        if start_step < 0 or num_steps < 1:
            raise ValueError(f"MemorySnapshot needs start_step >= 0 and num_steps >= 1, got {start_step}, {num_steps}")
        if mode not in ("forward", "step"):
            raise ValueError(f"MemorySnapshot mode must be 'forward' or 'step', got {mode!r}")
        self._start_step = start_step
        self._last_step = start_step + num_steps - 1
        self._mode = mode
        self._max_entries = max_entries
        self._active = False
        self._recording = False
        self._forward_peak = 0
        self._out_dir: Path | None = None
        self._rank = 0
        self.snapshot_path: Path | None = None
        """Where this rank's snapshot was written, once it has been."""
        self.peaks: list[dict[str, float]] = []
        """Per step: ``step``, ``peak_forward_gib``, ``peak_step_gib``."""

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._out_dir = Path(trainer.log_dir or trainer.default_root_dir)
        self._rank = trainer.global_rank
        self._active = trainer.strategy.root_device.type == "cuda"
        if not self._active:
            rank_zero_warn(
                "MemorySnapshot needs a CUDA device (this run is on "
                f"{trainer.strategy.root_device.type}): no snapshot and no peak memory will be recorded"
            )

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._active:
            return
        torch.cuda.reset_peak_memory_stats()
        if trainer.global_step == self._start_step and not self._recording and self.snapshot_path is None:
            record_memory_history(self._max_entries)
            self._recording = True

    @override
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if not self._active:
            return
        self._forward_peak = torch.cuda.max_memory_allocated()
        if self._mode == "forward" and self._recording and trainer.global_step == self._last_step:
            self._dump()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._active:
            return
        # Lightning has already counted the step that just ran: global_step is one ahead of it.
        step = trainer.global_step - 1
        peak = {
            "step": step,
            "peak_forward_gib": self._forward_peak / _GIB,
            "peak_step_gib": torch.cuda.max_memory_allocated() / _GIB,
        }
        self.peaks.append(peak)
        pl_module.log("memory/peak_forward_gib", peak["peak_forward_gib"], on_step=True, on_epoch=False)
        pl_module.log("memory/peak_step_gib", peak["peak_step_gib"], on_step=True, on_epoch=False)
        if self._recording and step == self._last_step:
            self._dump()

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._recording:
            rank_zero_warn(f"MemorySnapshot: training ended before step {self._last_step}; dumping what was recorded")
            self._dump()
        elif self._active and self.snapshot_path is None:
            rank_zero_warn(
                f"MemorySnapshot recorded nothing: training stopped before step {self._start_step} "
                "(lower the callback's start_step or raise --trainer.max_steps)"
            )

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # An OOM is exactly when the snapshot is most wanted.
        if self._recording:
            self._dump()

    def _dump(self) -> None:
        assert self._out_dir is not None, "MemorySnapshot.setup was not called"
        self._out_dir.mkdir(parents=True, exist_ok=True)
        steps = (
            f"{self._start_step}" if self._last_step == self._start_step else f"{self._start_step}-{self._last_step}"
        )
        self.snapshot_path = self._out_dir / f"memory_snapshot_rank{self._rank}_step{steps}.pickle"
        dump_memory_snapshot(str(self.snapshot_path))
        record_memory_history(None)
        self._recording = False
        rank_zero_info(f"MemorySnapshot: wrote {self.snapshot_path} (open it at https://pytorch.org/memory_viz)")
