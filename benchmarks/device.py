"""Device housekeeping every benchmark shares: the ``--device`` flag, timing, peak memory, freeing memory."""

from __future__ import annotations

import argparse
import gc
import time
from typing import Callable

import torch


def add_device_arg(parser: argparse.ArgumentParser) -> None:
    """``--device cuda|cpu``, as a torch.device; cuda by default where a GPU is visible."""
    parser.add_argument(
        "--device",
        type=_device,
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda or cpu (default: cuda where a GPU is visible)",
    )


def _device(name: str) -> torch.device:
    if name not in ("cuda", "cpu"):
        raise argparse.ArgumentTypeError(f"choose cuda or cpu, got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError("cuda, but no CUDA device is visible: pass --device cpu")
    return torch.device(name)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU): brackets every timed region."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds ``fn()`` takes with the device work it queues, the device synchronised before and after."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated memory since the last reset, in GiB; NaN on the CPU, where it is not tracked."""
    return torch.cuda.max_memory_allocated(device) / 1024**3 if device.type == "cuda" else float("nan")


def allocated_gib(device: torch.device) -> float:
    """Memory held by live tensors now, in GiB; NaN on the CPU, where it is not tracked."""
    return torch.cuda.memory_allocated(device) / 1024**3 if device.type == "cuda" else float("nan")


def free_memory(device: torch.device) -> None:
    """Give back what dropped models held."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
