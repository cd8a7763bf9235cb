"""Where a step's GPU time goes: compute kernels, NCCL kernels, their overlap, and the GPU left idle.

``profile_kernels(fn)`` runs ``fn`` once under torch.profiler (CUDA activity only) and reads the kernel
intervals from its Chrome trace; ``summarize_kernels`` turns intervals into the numbers a data-parallel
engineer asks for: how long communication ran, how much of it hid under compute, and how long the GPU
waited for the CPU (idle gaps inside the step: a launch-bound backward shows up here).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterable

import torch

Interval = tuple[float, float]  # (start, end) in microseconds


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Merge overlapping intervals into disjoint ones, sorted."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def total(intervals: Iterable[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def intersection(a: list[Interval], b: list[Interval]) -> float:
    """Length of time covered by both disjoint, sorted interval lists."""
    covered, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        covered += max(0.0, end - start)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return covered


def summarize_kernels(kernels: list[tuple[str, float, float]]) -> dict[str, float]:
    """(name, start µs, duration µs) per kernel → milliseconds of compute, communication, overlap and idle."""
    if not kernels:
        return {}
    comm = union((s, s + d) for name, s, d in kernels if "nccl" in name.lower())
    compute = union((s, s + d) for name, s, d in kernels if "nccl" not in name.lower())
    busy = union(comm + compute)
    span = busy[-1][1] - busy[0][0]
    comm_ms = total(comm) / 1e3
    hidden_ms = intersection(comm, compute) / 1e3
    return {
        "gpu_span_ms": span / 1e3,
        "compute_ms": total(compute) / 1e3,
        "comm_ms": comm_ms,
        "comm_hidden_frac": hidden_ms / comm_ms if comm_ms else float("nan"),
        "comm_exposed_ms": comm_ms - hidden_ms,
        "gpu_idle_ms": (span - total(busy)) / 1e3,
    }


def profile_kernels(fn: Callable[[], None]) -> dict[str, float]:
    """Run ``fn`` once under the profiler and summarize its kernels (empty without CUDA)."""
    if not torch.cuda.is_available():
        return {}
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [(e["name"], float(e["ts"]), float(e["dur"])) for e in trace_events(prof) if e.get("cat") == "kernel"]
    return summarize_kernels(kernels)


def trace_events(prof: torch.profiler.profile) -> list[dict]:
    """The Chrome-trace events of a finished profiler run."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]
    finally:
        os.remove(path)
