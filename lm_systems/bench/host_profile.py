"""Where a data-parallel step's host time goes, thread by thread: ``python -m lm_systems.bench.host_profile``.

On hosts where the xl backward is launch-bound, a data-parallel variant is as fast as the CUDA calls it
adds to the threads that launch backward's kernels. This runs one step of each variant under
torch.profiler (CPU and CUDA activity) on every rank at once, after warm-up steps, and reports per rank,
host thread and category (CUDA runtime calls, driver calls, operators, annotations) the total time, the number of
calls and the five largest entries: e.g. how many CUDA calls a launch thread makes per all-reduce, and
how long backward's own ``cudaLaunchKernel`` calls took beside them. One profiled step per variant on a
drifting host: read the counts, and the durations as orders of magnitude. Every rank is profiled, not
only rank 0, because the ranks differ: in a data-parallel step one rank's host can lag while the other's
collectives wait for it, and which one lags varies. Operator times nest (a
parent includes its children), so their totals overcount. Variants are bench.ddp's names.
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict

import torch
import torch.distributed as dist

from lm_systems.bench.ddp import (add_setup_args, add_warmed_variant_args, check_setup_args, for_each_warmed_variant,
                                  run_label, setup_description)
from lm_systems.bench.gpu_timeline import trace_events
from lm_systems.bench.ranks import spawn_ranks, synchronize
from lm_systems.bench.report import write_results

DEFAULT_VARIANTS = ["single", "bucketed_25+thread", "bucketed_1000+thread", "torch_ddp"]
CATEGORIES = ("cuda_runtime", "cuda_driver", "cpu_op", "user_annotation")
MIN_OPERATOR_MS = 2.0  # operator and annotation rows below this per thread are left out; CUDA rows never


def summarize_host(events: list[dict], variant: str, rank: int) -> list[dict]:
    """Chrome-trace events of ``rank`` → one row per (thread, category): total ms, calls, the five largest entries."""
    time: dict[tuple[str, int], Counter] = defaultdict(Counter)
    calls: dict[tuple[str, int], Counter] = defaultdict(Counter)
    for event in events:
        if event.get("ph") == "X" and event.get("cat") in CATEGORIES and "dur" in event:
            key = (event["cat"], event.get("tid"))
            time[key][event["name"]] += event["dur"]
            calls[key][event["name"]] += 1
    rows = []
    for (category, thread), spent in sorted(time.items(), key=lambda item: -sum(item[1].values())):
        total_ms = sum(spent.values()) / 1e3
        if not category.startswith("cuda") and total_ms < MIN_OPERATOR_MS:
            continue
        top = ", ".join(f"{name[:40]} {us / 1e3:.1f} ms/{calls[(category, thread)][name]}"
                        for name, us in spent.most_common(5))
        rows.append({"variant": variant, "rank": rank, "thread": thread, "category": category, "total_ms": total_ms,
                     "calls": sum(calls[(category, thread)].values()), "largest": top})
    return rows


def profile_step(step, batch: torch.Tensor, device: torch.device) -> list[dict]:
    """Run ``step(batch)`` once under the profiler; its Chrome-trace events."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        step(batch)
        synchronize(device)
    return trace_events(prof)


def _worker(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    def visit(name: str, step, device: torch.device, batch: torch.Tensor) -> None:
        synchronize(device)
        dist.barrier()
        events = profile_step(step, batch, device) if step is not None else []
        for row in summarize_host(events, name, rank):
            queue.put(row)
        dist.barrier()

    for_each_warmed_variant(rank, args, port, visit)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_setup_args(parser)
    add_warmed_variant_args(parser, DEFAULT_VARIANTS, "steps before the profiled one")
    args = parser.parse_args(argv)
    check_setup_args(parser, args)
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    return spawn_ranks(_worker, args, args.nproc, lambda rows: _write(rows, args))


def _write(rows: list[dict], args: argparse.Namespace) -> None:
    rows.sort(key=lambda row: (args.variants.index(row["variant"]), row["rank"]))
    notes = (f"{setup_description(args)}; every rank, one profiled step per variant after {args.warmup} warm-up "
             "steps. thread: the host thread's id; total_ms and calls per (rank, thread, category); largest: the "
             "five largest entries as time/calls. Operator times nest, so their totals overcount.")
    write_results(f"host_profile_{run_label(args)}", rows, title="Host time per thread, one data-parallel step",
                  notes=notes, out_dir=args.out_dir)


if __name__ == "__main__":
    main()
