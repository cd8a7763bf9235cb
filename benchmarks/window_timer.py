"""WindowTimer: the callback ``benchmarks.scaling`` adds to each train.py run it launches, timing windows of steps
on every rank (and tracing a few more with ``--trace-steps``)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lm_systems.compat.lightning import compute_dtype
from lm_systems.profiling.hardware import peak_flops


class WindowTimer(Callback):
    """Times ``segments`` segments of ``steps`` optimizer steps after ``warmup`` untimed ones, synchronising the
    device only at segment boundaries; writes ``rank{r}.json`` (segment milliseconds per step, peak GiB) to
    ``out_dir``. With ``trace_steps``, torch.profiler then records that many more steps (the device's activity:
    kernels, copies and the CUDA runtime's calls) into ``trace_rank{r}.json.gz``, outside the timed segments."""

    def __init__(self, out_dir: str, warmup: int, steps: int, segments: int, trace_steps: int = 0) -> None:
        super().__init__()
        self._out_dir, self._warmup, self._steps, self._segments = Path(out_dir), warmup, steps, segments
        self._trace_steps = trace_steps
        self._segment_ms: list[float] = []
        self._started = 0.0
        self._timed_from_unix = 0.0
        self._profiler: torch.profiler.profile | None = None

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._time(trainer)
        if self._trace_steps:
            self._trace(trainer)

    def _time(self, trainer: L.Trainer) -> None:
        step = trainer.global_step
        if step < self._warmup or (step - self._warmup) % self._steps or len(self._segment_ms) == self._segments:
            return
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        if step == self._warmup:
            self._timed_from_unix = time.time()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
        else:
            self._segment_ms.append(1e3 * (now - self._started) / self._steps)
            if len(self._segment_ms) == self._segments:
                self._write(trainer, device)
        self._started = time.perf_counter()

    def _trace(self, trainer: L.Trainer) -> None:
        """Start the profiler where the timed segments end and stop it ``trace_steps`` steps later, the device
        synchronised at both ends so that the trace spans whole steps. (The step count only grows: once stopped,
        it never reads ``start`` again.)"""
        start = self._warmup + self._steps * self._segments
        step, device = trainer.global_step, trainer.strategy.root_device
        starting = self._profiler is None and step == start
        stopping = self._profiler is not None and step == start + self._trace_steps
        if not (starting or stopping):
            return
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if starting:
            activity = torch.profiler.ProfilerActivity
            self._profiler = torch.profiler.profile(
                activities=[activity.CUDA if device.type == "cuda" else activity.CPU]
            )
            self._profiler.start()
            return
        self._profiler.stop()
        self._out_dir.mkdir(parents=True, exist_ok=True)
        self._profiler.export_chrome_trace(str(self._out_dir / f"trace_rank{trainer.global_rank}.json.gz"))
        self._profiler = None

    def _write(self, trainer: L.Trainer, device: torch.device) -> None:
        peak = torch.cuda.max_memory_allocated(device) / 1024**3 if device.type == "cuda" else float("nan")
        self._out_dir.mkdir(parents=True, exist_ok=True)
        flops = getattr(trainer.lightning_module, "flops_per_batch", None)
        record = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "segment_ms": self._segment_ms,
            "peak_GiB": peak,
            "timed_from_unix": self._timed_from_unix,
            "flops_per_step": flops * trainer.accumulate_grad_batches if flops else None,
            "peak_flops": peak_flops(device, compute_dtype(trainer)),
        }
        (self._out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
