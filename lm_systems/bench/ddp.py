"""Data-parallel training benchmark: ``python -m lm_systems.bench.ddp --size xl --nproc 2``.

Trains a TransformerLM (default xl, batch 4 per rank, context 512, bf16 autocast, fused AdamW) in a plain
PyTorch loop on ``--nproc`` processes started with torch.multiprocessing (no torchrun, no Trainer: the loop
is the same for every variant, so the step times compare the gradient synchronisation alone). Variants
(``lm_systems.bench.ddp_variants``) are visited one at a time, interleaved round by round, a fresh model
each visit. Per variant: step time (median, slowest rank), the phases of a few separately synchronised
steps (forward, backward, gradient sync left after backward, optimizer), tokens/s, scaling efficiency (single-rank step time / step time), peak memory and optimizer-state bytes per rank, and
whether all replicas hold identical weights. Ratios are taken within each round, then the median over
rounds. For ratios of a few percent on drifting hosts use ``bench.ddp_paired``.
"""

from __future__ import annotations

import argparse
import statistics
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from lm_systems.bench.ddp_variants import (Variant, add_setup_args, build, check_setup_args, checked_variant,
                                           make_step, rank_config_and_batch, release, run_label, setup_description)
from lm_systems.bench.device import free_memory, synchronize
from lm_systems.bench.ranks import init_rank, spawn_ranks
from lm_systems.bench.report import write_results
from lm_systems.parallel import gradient_process_group

GB = 1e9
DEFAULT_VARIANTS = ["single", "torch_ddp", "naive", "naive_flat", "overlap", "bucketed_1", "bucketed_25",
                    "bucketed_100", "bucketed_1000", "zero1", "zero1_broadcast", "torch_zero"]
PHASES = ("forward", "backward", "sync", "optimizer")


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    if isinstance(optimizer, ZeroRedundancyOptimizer):  # a ShardedOptimizer's state is its shard already
        optimizer = optimizer.optim
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


def measure(step, optimizer: torch.optim.Optimizer, batch: torch.Tensor, args: argparse.Namespace,
            device: torch.device) -> dict:
    """Warm-up, timed steps (synchronised per step) and phase-instrumented steps, on this rank."""
    for _ in range(args.warmup):
        step(batch)
    step_times = []
    for _ in range(args.steps):
        synchronize(device)
        start = time.perf_counter()
        step(batch)
        synchronize(device)
        step_times.append(time.perf_counter() - start)
    phases: dict[str, list[float]] = {name: [] for name in PHASES}
    for _ in range(args.instrumented_steps):
        synchronize(device)
        marks = [time.perf_counter()]
        step(batch, lambda: (synchronize(device), marks.append(time.perf_counter())))
        for name, a, b in zip(PHASES, marks, marks[1:]):
            phases[name].append(b - a)
    params = optimizer.param_groups[0]["params"]
    return {
        "step_s": statistics.median(step_times),
        **{f"{k}_s": statistics.median(v) if v else float("nan") for k, v in phases.items()},
        "peak_mem": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else float("nan"),
        "opt_state": optimizer_state_bytes(optimizer),
        "checksum": torch.stack([p.detach().double().sum() for p in params]).sum().item(),
    }


def visit(name: str, args: argparse.Namespace, device: torch.device, groups: dict) -> dict | None:
    """Build, measure and free one variant; rank 0 returns the row (slowest rank's time, largest memory,
    or None when it failed (the error is printed). ``groups`` caches the
    communication groups variants ask for (created on every rank, in the same order)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    config, batch = rank_config_and_batch(args, rank, device)
    variant = Variant.parse(name)
    if variant.group_key is not None and variant.group_key not in groups:
        groups[variant.group_key] = gradient_process_group(*variant.group_key)
    result = None
    if variant.base != "single" or rank == 0:
        free_memory(device, args.compile)
        held_before = 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            held_before = torch.cuda.memory_allocated(device)
        try:
            run = build(variant, config, device, groups.get(variant.group_key), args.compile)
            result = measure(make_step(run, args.precision, device), run.optimizer, batch, args, device)
            # What an earlier visit left allocated is not this variant's: count the peak above the start.
            result["peak_mem"] -= held_before
            release([run])
        except Exception as error:  # e.g. a kernel that fails to compile: every rank fails alike, and goes on
            traceback.print_exc()
            result = {"error": f"{type(error).__name__}: {error}"}
        run = None
    per_rank = [None] * world
    dist.all_gather_object(per_rank, result)
    ranks = [r for r in per_rank if r is not None]
    errors = [r["error"] for r in ranks if "error" in r]
    if rank != 0 or errors:
        if errors and rank == 0:
            print(f"{name} failed: {errors[0]}", flush=True)
        return None
    nproc = 1 if variant.base == "single" else world
    step_s = max(r["step_s"] for r in ranks)
    return {
        "variant": name, "nproc": nproc, "step_ms": step_s * 1e3,
        **{f"{k}_ms": max(r[f"{k}_s"] for r in ranks) * 1e3 for k in PHASES},
        "tokens_per_s": nproc * args.batch_size * args.context_length / step_s,
        "peak_mem_GB": max(r["peak_mem"] for r in ranks) / GB,
        "opt_state_GB": max(r["opt_state"] for r in ranks) / GB,
        "replicas_equal": len({r["checksum"] for r in ranks}) == 1,
    }


def summarize(rows: list[dict], baseline: str = "torch_ddp") -> list[dict]:
    """Median over rounds per variant; ratios and scaling efficiency taken within each round."""
    step_ms = {(r["round"], r["variant"]): r["step_ms"] for r in rows}
    summary = []
    for name in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == name]
        out = {"variant": name, "nproc": mine[0]["nproc"]}
        for k in ("step_ms", *(f"{p}_ms" for p in PHASES), "tokens_per_s", "peak_mem_GB", "opt_state_GB"):
            values = [r[k] for r in mine if k in r]
            if values:
                out[k] = statistics.median(values)
        for column, other, ratio in ((f"vs_{baseline}", baseline, lambda mine, other: mine / other),
                                     ("scaling_eff", "single", lambda mine, other: other / mine)):
            ratios = [ratio(r["step_ms"], step_ms[(r["round"], other)]) for r in mine if (r["round"], other) in step_ms]
            out[column] = statistics.median(ratios) if ratios else float("nan")
        out["replicas_equal"] = all(r["replicas_equal"] for r in mine)
        out["rounds"] = len(mine)
        summary.append(out)
    return summary


def zero1_memory_notes(summary: list[dict], nproc: int) -> str:
    """Peak-memory saving of each ZeRO variant against its DDP counterpart, and the target of 90% of the ideal."""
    by_name = {r["variant"]: r for r in summary}
    lines = []
    for zero, ddp in (("zero1", "bucketed_25"), ("zero1_broadcast", "bucketed_25"), ("torch_zero", "torch_ddp")):
        if zero in by_name and ddp in by_name:
            full_state = by_name[ddp]["opt_state_GB"]
            saved = by_name[ddp]["peak_mem_GB"] - by_name[zero]["peak_mem_GB"]
            target = 0.9 * (1 - 1 / nproc) * full_state
            lines.append(f"- {zero} vs {ddp}: peak memory {saved:.2f} GB lower per rank; target ≥ 0.9·(1−1/N)·"
                         f"{full_state:.2f} GB optimizer state = {target:.2f} GB ({'met' if saved >= target else 'missed'}); "
                         f"step time ×{by_name[zero]['step_ms'] / by_name[ddp]['step_ms']:.3f}")
    return "\n".join(lines)


def _bar_plot(summary: list[dict], title: str):
    def plot(path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 0.35 * len(summary) + 1.5))
        ax.barh([r["variant"] for r in summary], [r["step_ms"] for r in summary], color="tab:blue")
        ax.invert_yaxis()
        ax.set(xlabel="step time (ms)", title=title)
        for i, r in enumerate(summary):
            ax.text(r["step_ms"], i, f" {r['step_ms']:.4g}", va="center", fontsize=8)
        ax.grid(True, axis="x", alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)

    return plot


def _agree(value: bool) -> bool:
    """Rank 0's decision, on every rank."""
    decision = [value]
    dist.broadcast_object_list(decision, src=0)
    return decision[0]


def _worker(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    """Rank 0 sends each row as soon as it is measured, so a later failure still leaves the earlier ones."""
    device = init_rank(rank, args.nproc, port, "nccl" if args.device == "cuda" else "gloo", args.timeout_s)
    start = time.perf_counter()
    groups: dict = {}
    try:
        for round_ in range(args.rounds):
            for name in args.variants:
                if not _agree(time.perf_counter() - start < args.time_budget_s):
                    return
                row = visit(name, args, device, groups)
                if row is not None:
                    queue.put({"round": round_, **row})
                    print(f"[{time.perf_counter() - start:6.1f}s] round {round_} {name:>16}: {row['step_ms']:8.2f} ms"
                          f"  sync {row['sync_ms']:7.2f} ms  {row['peak_mem_GB']:6.2f} GB", flush=True)
    finally:
        for group in groups.values():
            if group is not None:  # None: the default group, on gloo
                dist.destroy_process_group(group)
        dist.destroy_process_group()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_setup_args(parser)
    parser.add_argument("--variants", type=lambda s: [checked_variant(v) for v in s.split(",")],
                        default=DEFAULT_VARIANTS, help="comma-separated; see lm_systems.bench.ddp_variants")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds over the variants")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per visit")
    parser.add_argument("--instrumented-steps", type=int, default=2, help="steps timed phase by phase")
    parser.add_argument("--time-budget-s", type=float, default=float("inf"), help="start no visit after this")
    args = parser.parse_args(argv)
    check_setup_args(parser, args)
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark; returns the per-round rows (the file holds their summary)."""
    args = parse_args(argv)
    return spawn_ranks(_worker, args, args.nproc, lambda rows: write_summary(rows, args))


def write_summary(rows: list[dict], args: argparse.Namespace) -> None:
    setup = f"{setup_description(args)}, {'fused ' if args.device == 'cuda' else ''}AdamW, {args.nproc} processes"
    method = ("Plain PyTorch loop, processes started by torch.multiprocessing.spawn (no torchrun, no Trainer); "
              f"variants interleaved over {args.rounds} rounds, a fresh model per visit; {args.warmup} warm-up, "
              f"{args.steps} timed steps (median, slowest rank), {args.instrumented_steps} phase-instrumented steps. "
              "sync_ms: gradient averaging left after backward (torch DDP waits inside backward, so 0 there). "
              "scaling_eff: single-rank step time / step time. vs_torch_ddp: step-time ratio in the same round. "
              "peak_mem_GB: the visit's peak allocation above what was allocated when it started.")
    columns = ["variant", "nproc", "step_ms", "vs_torch_ddp", "scaling_eff", "tokens_per_s",
               *(f"{p}_ms" for p in PHASES), "peak_mem_GB",
               "opt_state_GB", "replicas_equal", "rounds"]
    summary = summarize(rows)
    write_results(f"ddp_{run_label(args)}", summary, title=f"Data-parallel strategies: {setup}",
                  notes=method + "\n\n" + zero1_memory_notes(summary, args.nproc), columns=columns,
                  plot=_bar_plot(summary, setup), out_dir=args.out_dir)


if __name__ == "__main__":
    main()
