"""Both ranks' GPU timelines of one data-parallel turn, side by side: ``python -m lm_systems.bench.rank_timeline``.

``bench.ddp --profile`` reads rank 0's kernels alone, so an NCCL kernel that runs long cannot say whether
it moved data slowly or sat waiting for the other rank to launch its half. Here every rank profiles the
same turn (``--steps-per-turn`` back-to-back steps after a barrier, as ``bench.ddp_paired`` times them),
and the timelines are aligned on a one-element all-reduce that opens the turn (it ends on all GPUs
together). The n-th collective of a rank is the n-th of every rank (launch order is the same), so per
collective we see when each rank's kernel started and when the last one joined:

- ``wait_ms``: how long this rank's NCCL kernels sat resident before the other rank's joined (a
  collective cannot move data until both are in; meanwhile its thread blocks hold SMs);
- ``joint_ms``: the time collectives ran with every rank in (the data movement, plus contention);
- ``queued``: collectives that started within 20 µs of the previous one's end on this rank, i.e. were
  waiting behind it (communication-bound) rather than for their gradients (compute-bound);
- ``compute_ms`` (busy time of all other kernels), ``gemm_ms`` (of matmul kernels: against ``single``
  it shows how much running beside communication slows compute), ``idle_ms`` (no kernel and no copy
  running: the GPU waited for the host), and the host's own per-step times: returning from forward
  and from backward (issuing them, on a host that runs ahead), and waiting in the gradient sync.

One profiled turn per variant per ``--turns``; a reading, not a benchmark of speed.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from lm_systems.bench.ddp import (add_setup_args, add_warmed_variant_args, check_setup_args, for_each_warmed_variant,
                                  run_label, setup_description)
from lm_systems.bench.gpu_timeline import intersection, total, trace_events, union
from lm_systems.bench.ranks import spawn_ranks, synchronize
from lm_systems.bench.report import write_results

DEFAULT_VARIANTS = ["single", "no_comm", "bucketed_25+thread", "bucketed_1000+thread", "torch_ddp"]
GEMM_MARKERS = ("gemm", "nvjet", "cutlass", "xmma")
QUEUED_GAP_US = 20.0
Event = tuple[str, float, float, bool]  # (name, start µs, duration µs, is communication)


def is_comm(name: str, category: str) -> bool:
    """NCCL kernels and GPU copies (the copy-engine averager's peer copies) are communication."""
    return "nccl" in name.lower() or category == "gpu_memcpy"


def read_events(trace_events: list[dict]) -> list[Event]:
    """Kernels and copies of a Chrome trace, sorted by start."""
    events = [(e["name"], float(e["ts"]), float(e["dur"]), is_comm(e["name"], e["cat"]))
              for e in trace_events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    return sorted(events, key=lambda e: e[1])


def collectives(events: list[Event]) -> list[tuple[float, float]]:
    """(start, end) of each NCCL kernel, in launch order."""
    return [(s, s + d) for name, s, d, _ in events if "nccl" in name.lower()]


def align(events: list[Event]) -> list[Event]:
    """Shift times so that 0 is the end of the first NCCL kernel (the turn's opening all-reduce), which
    ends on every rank at once; that kernel is dropped."""
    anchor = next((i for i, e in enumerate(events) if "nccl" in e[0].lower()), None)
    if anchor is None:
        raise ValueError("no NCCL kernel in the trace: the turn opens with an all-reduce to align on")
    zero = events[anchor][1] + events[anchor][2]
    return [(n, s - zero, d, c) for i, (n, s, d, c) in enumerate(events) if i != anchor]


def pair_collectives(per_rank: list[list[tuple[float, float]]]) -> list[dict[str, float]]:
    """Per rank: waited (µs its kernels sat before the last rank's joined), joint (µs with all ranks in)
    and queued (collectives that started within QUEUED_GAP_US of this rank's previous one ending)."""
    counts = {len(c) for c in per_rank}
    if len(counts) != 1:
        raise ValueError(f"ranks ran different numbers of collectives: {[len(c) for c in per_rank]}")
    stats = [{"waited_us": 0.0, "joint_us": 0.0, "queued": 0} for _ in per_rank]
    for k, spans in enumerate(zip(*per_rank)):
        joined = max(start for start, _ in spans)
        for rank, (start, end) in enumerate(spans):
            stats[rank]["waited_us"] += joined - start
            stats[rank]["joint_us"] += max(0.0, end - joined)
            if k > 0 and start - per_rank[rank][k - 1][1] <= QUEUED_GAP_US:
                stats[rank]["queued"] += 1
    return stats


def summarize_rank(events: list[Event]) -> dict[str, float]:
    """Busy, idle and matmul time of one rank's aligned turn, in ms."""
    if not events:
        return {}
    comm = union((s, s + d) for _, s, d, c in events if c)
    compute = union((s, s + d) for _, s, d, c in events if not c)
    busy = union(comm + compute)
    span = busy[-1][1] - max(0.0, busy[0][0])
    return {
        "span_ms": span / 1e3,
        "compute_ms": total(compute) / 1e3,
        "gemm_ms": sum(d for n, _, d, c in events if not c and any(m in n.lower() for m in GEMM_MARKERS)) / 1e3,
        "comm_ms": total(comm) / 1e3,
        "comm_under_compute_ms": intersection(comm, compute) / 1e3,
        "idle_ms": (span - total(busy)) / 1e3,
    }


def turn_rows(variant: str, turn: int, per_rank: list[dict], steps: int) -> list[dict]:
    """One row per rank from every rank's aligned events and host step times."""
    stats = [None] * len(per_rank)
    if all(r["events"] for r in per_rank) and any(collectives(r["events"]) for r in per_rank):
        stats = pair_collectives([collectives(r["events"]) for r in per_rank])
    rows = []
    for rank, (record, stat) in enumerate(zip(per_rank, stats)):
        if not record["events"]:
            continue
        row = {"variant": variant, "turn": turn, "rank": rank, **summarize_rank(record["events"])}
        for key in ("span_ms", "compute_ms", "gemm_ms", "comm_ms", "comm_under_compute_ms", "idle_ms"):
            row[key] /= steps  # per step
        if stat is not None:
            row.update(collectives=len(collectives(record["events"])) // steps, wait_ms=stat["waited_us"] / 1e3 / steps,
                       joint_ms=stat["joint_us"] / 1e3 / steps, queued=stat["queued"] // steps)
        for phase, values in record["host"].items():
            row[f"host_{phase}_ms"] = statistics.median(values) * 1e3
        rows.append(row)
    return rows


def profile_turn(step, batch: torch.Tensor, steps: int, device: torch.device) -> tuple[list[dict], dict]:
    """Profile one turn on this rank: an aligning all-reduce, then ``steps`` steps (none where ``step`` is None)."""
    host: dict[str, list[float]] = {"forward": [], "backward": [], "sync": [], "step": []}
    anchor = torch.ones(1, device=device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        dist.all_reduce(anchor)
        for _ in range(steps if step is not None else 0):
            marks: list[float] = []
            step(batch, host_marks=marks)
            for phase, (a, b) in zip(("forward", "backward", "sync"), zip(marks, marks[1:])):
                host[phase].append(b - a)
            host["step"].append(marks[-1] - marks[0])
        synchronize(device)
    return trace_events(prof), host


def _worker(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    def visit(name: str, step, device: torch.device, batch: torch.Tensor) -> None:
        for turn in range(args.turns):
            synchronize(device)
            dist.barrier()
            trace, host = profile_turn(step, batch, args.steps_per_turn, device)
            record = {"events": align(read_events(trace)), "host": host}
            if args.save_traces is not None:
                args.save_traces.mkdir(parents=True, exist_ok=True)
                with gzip.open(args.save_traces / f"{name.replace('+', '-')}_turn{turn}_rank{rank}.json.gz", "wt") as f:
                    json.dump(record, f)
            if step is None:
                record["events"] = []  # the idle rank's anchor only: nothing to report
            gathered = [None] * args.nproc
            dist.all_gather_object(gathered, record)
            if rank == 0:
                for row in turn_rows(name, turn, gathered, args.steps_per_turn):
                    queue.put(row)
                    print({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}, flush=True)

    for_each_warmed_variant(rank, args, port, visit)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_setup_args(parser)
    add_warmed_variant_args(parser, DEFAULT_VARIANTS, "steps before the first profiled turn")
    parser.add_argument("--turns", type=int, default=2, help="profiled turns per variant")
    parser.add_argument("--steps-per-turn", type=int, default=3, help="back-to-back steps in a profiled turn")
    parser.add_argument("--save-traces", type=Path, default=None,
                        help="also write every rank's aligned events and host times here (json.gz)")
    args = parser.parse_args(argv)
    check_setup_args(parser, args)
    if args.device != "cuda":
        parser.error("rank_timeline reads GPU kernel timelines: it needs CUDA (--device cuda)")
    for flag in ("turns", "steps_per_turn"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    return spawn_ranks(_worker, args, args.nproc, lambda rows: _write(rows, args))


def _write(rows: list[dict], args: argparse.Namespace) -> None:
    notes = (f"{setup_description(args)}; every rank profiled over the same turn of {args.steps_per_turn} steps "
             f"after {args.warmup} warm-up steps, {args.turns} turn(s) per variant; times per step. Ranks aligned on "
             "the end of an opening one-element all-reduce. wait_ms: NCCL kernels resident before the other "
             "rank's joined; joint_ms: collectives running with both ranks in; queued: collectives that started "
             "right after the previous one ended; gemm_ms: matmul kernels' time; idle_ms: no kernel or copy ran; "
             "host_*: the host's own time per step until forward, backward, finish_gradient_synchronization "
             "and the whole step return.")
    write_results(f"rank_timeline_{run_label(args)}", rows, title="Both ranks' GPU timelines of a data-parallel turn",
                  notes=notes, out_dir=args.out_dir)


if __name__ == "__main__":
    main()
