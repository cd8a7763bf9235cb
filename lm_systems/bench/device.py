"""Device housekeeping every benchmark shares: wait for queued work, peak memory, give freed memory back."""

from __future__ import annotations

import gc

import torch


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU): brackets every timed region."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated memory since the last reset, in GiB; NaN on the CPU, where it is not tracked."""
    return torch.cuda.max_memory_allocated(device) / 1024**3 if device.type == "cuda" else float("nan")


def free_memory(device: torch.device, compile_mode: str | None = None) -> None:
    """Give back what dropped models held. Under torch.compile's ``reduce-overhead`` that takes dropping the
    compiled code too: its CUDA graphs' memory pools belong to torch's global cudagraph trees, not to the
    models, and pile up visit after visit; the next model compiles afresh (from inductor's cache)."""
    if compile_mode == "reduce-overhead":
        torch._dynamo.reset()  # also resets the cudagraph trees
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
