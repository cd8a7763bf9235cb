"""Where a traced window's time went on one rank: ``python -m benchmarks.gpu_timeline TRACE.json --steps N``.

Reads a torch.profiler Chrome trace (``export_chrome_trace``; Lightning's ``PyTorchProfiler`` writes one too) of
``N`` optimizer steps and divides the window, per step, into the GPU's work and its waiting:

    compute_ms      kernels other than NCCL's, as a union of intervals (two streams at once count once)
    nccl_ms         NCCL's kernels; nccl_exposed_ms is the part no compute kernel ran beside, and
                    exposed_all_gather_ms, exposed_reduce_scatter_ms, exposed_all_reduce_ms that part of each
                    collective's kernels (a kernel that waits for the other rank counts while it waits)
    gpu_idle_ms     nothing on the GPU (no kernel, copy or memset): the host had not launched the next work yet,
                    or the GPU waited on the other rank
    host_sync_ms    the host blocked in the CUDA runtime waiting for the GPU (synchronizes, blocking copies)
    launches        kernel launches by the host per step

A host-bound step shows a large gpu_idle_ms and a small host_sync_ms; a GPU-bound one the reverse; a step held by
the link a large nccl_exposed_ms. The window runs from the trace's first event to its last (torch.profiler writes
one span of its whole session, "PyTorch Profiler (0)", so the host's time between steps counts), so trace whole
steps with the device synchronised at both ends (``benchmarks.scaling --trace-steps`` does).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
from pathlib import Path
from typing import Iterable

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATEGORIES = ("cuda_runtime", "cuda_driver")
# NCCL's kernel names carry the collective (ncclDevKernel_AllGather_RING_LL, ..._ReduceScatter_Sum_bf16_...).
COLLECTIVES = {"all_gather": "allgather", "reduce_scatter": "reducescatter", "all_reduce": "allreduce"}
COLUMNS = [
    "traced_ms_per_step",
    "compute_ms",
    "nccl_ms",
    "nccl_exposed_ms",
    *(f"exposed_{op}_ms" for op in COLLECTIVES),
    "gpu_idle_ms",
    "host_sync_ms",
    "launches",
]

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, non-overlapping intervals covering the same time."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def covered(intervals: list[Interval]) -> float:
    """Total length of ``union``'s output."""
    return sum(end - start for start, end in intervals)


def overlap(a: list[Interval], b: list[Interval]) -> float:
    """Time covered by both of two ``union`` outputs."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _interval(event: dict) -> Interval:
    return event["ts"], event["ts"] + event["dur"]


def _blocks_host(name: str) -> bool:
    return "Synchronize" in name or name in ("cudaMemcpy", "cuMemcpyDtoH_v2", "cuMemcpyHtoD_v2")


def summarize(events: list[dict], steps: int) -> dict[str, float]:
    """``COLUMNS`` per step (milliseconds; launches a count) of a trace's complete events (``ph`` "X", times in
    microseconds)."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    if not spans:
        raise ValueError("the trace has no complete events (ph 'X'): was it exported by torch.profiler?")
    window = max(e["ts"] + e["dur"] for e in spans) - min(e["ts"] for e in spans)
    kernels = [e for e in spans if e.get("cat") == "kernel"]
    nccl_kernels = [e for e in kernels if "nccl" in e["name"].lower()]
    nccl = union(_interval(e) for e in nccl_kernels)
    compute = union(_interval(e) for e in kernels if "nccl" not in e["name"].lower())
    busy = union(_interval(e) for e in spans if e.get("cat") in GPU_CATEGORIES)
    host = [e for e in spans if e.get("cat") in HOST_CATEGORIES]
    per_step = 1e-3 / steps  # microseconds in the window to milliseconds a step
    row = {"traced_ms_per_step": window * per_step}
    # A trace without GPU work or without the CUDA runtime's events (a CPU run) cannot tell: not a number, not 0.
    gpu_ran = bool(busy)
    row["compute_ms"] = covered(compute) * per_step if gpu_ran else math.nan
    row["nccl_ms"] = covered(nccl) * per_step if gpu_ran else math.nan
    row["nccl_exposed_ms"] = (covered(nccl) - overlap(nccl, compute)) * per_step if gpu_ran else math.nan
    for op, key in COLLECTIVES.items():
        ran = union(_interval(e) for e in nccl_kernels if key in e["name"].lower().replace("_", ""))
        row[f"exposed_{op}_ms"] = (covered(ran) - overlap(ran, compute)) * per_step if gpu_ran else math.nan
    row["gpu_idle_ms"] = (window - covered(busy)) * per_step if gpu_ran else math.nan
    row["host_sync_ms"] = sum(e["dur"] for e in host if _blocks_host(e["name"])) * per_step if host else math.nan
    row["launches"] = (
        sum("LaunchKernel" in e["name"] or e["name"] == "cudaGraphLaunch" for e in host) / steps if host else math.nan
    )
    return row


def summarize_file(path: Path, steps: int) -> dict[str, float]:
    """``summarize`` of a trace file, JSON or gzipped JSON (``.json.gz``, as torch.profiler exports to that suffix)."""
    path = Path(path)
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    return summarize(json.loads(text)["traceEvents"], steps)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "traces", nargs="+", type=Path, help="Chrome traces exported by torch.profiler (.json, or .json.gz)"
    )
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps each trace covers")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    print("| trace | " + " | ".join(COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    for path in args.traces:
        row = summarize_file(path, args.steps)
        print(f"| {path.name} | " + " | ".join(f"{row[c]:.1f}" for c in COLUMNS) + " |")


if __name__ == "__main__":
    main()
