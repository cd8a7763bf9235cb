"""Paired A/B step times of data-parallel variants: ``python -m lm_systems.bench.ddp_paired``.

On the lent GPU hosts step times drift by ±20% within minutes, even for one GPU alone, which swamps
differences of a few percent between variants measured tens of seconds apart (``bench.ddp`` visits one
variant at a time). Here both variants of a pair live on the GPUs at once and their steps alternate
(A B, B A, A B, ...) in turns of ``--steps-per-turn`` back-to-back steps; every turn starts on all
ranks together (a barrier) and is timed to completion on the slowest rank, per step. Within a turn a
step's tail may overlap the next step's start, as in training, where nothing synchronises the host
with the GPU between steps. The pair's ratio is the median over
iterations of B's time per step over the adjacent A's, so drift slower than two turns cancels. ``single`` steps run on rank 0 alone: a pair
``single:X`` gives X's scaling efficiency (single / X, per-rank throughput against one GPU).

Pairs take the variant names and options of ``lm_systems.bench.ddp_variants`` (``torch_ddp:bucketed_25+ctas16``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from lm_systems.bench.ddp_variants import (Variant, add_setup_args, build, check_setup_args, checked_variant,
                                           make_step, rank_config_and_batch, release, run_label, setup_description)
from lm_systems.bench.device import free_memory, synchronize
from lm_systems.bench.ranks import init_rank, spawn_ranks
from lm_systems.bench.report import write_results
from lm_systems.parallel import gradient_process_group

DEFAULT_PAIRS = ["single:torch_ddp", "single:bucketed_25", "torch_ddp:bucketed_25", "torch_ddp:bucketed_100",
                 "torch_ddp:bucketed_1000", "torch_ddp:naive_flat", "bucketed_25:zero1", "torch_ddp:torch_zero"]


def time_pair(names: tuple[str, str], args: argparse.Namespace, device: torch.device,
              groups: dict) -> tuple[list[float], list[float]]:
    """Alternating step times (seconds, slowest rank) of the two variants, on every rank."""
    rank = dist.get_rank()
    config, batch = rank_config_and_batch(args, rank, device)
    steps = []
    for name in names:
        variant = Variant.parse(name)
        if variant.group_key is not None and variant.group_key not in groups:
            groups[variant.group_key] = gradient_process_group(*variant.group_key)
        here = variant.base != "single" or rank == 0
        group = groups.get(variant.group_key)
        run = build(variant, config, device, group, args.compile) if here else None
        steps.append((make_step(run, args.precision, device) if here else None, run))
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(args.warmup + args.iterations):
        for which in ((0, 1) if i % 2 == 0 else (1, 0)):
            step = steps[which][0]
            dist.barrier()
            synchronize(device)
            start = time.perf_counter()
            for _ in range(args.steps_per_turn if step is not None else 0):
                step(batch)
            synchronize(device)
            elapsed = torch.tensor([(time.perf_counter() - start) / args.steps_per_turn], dtype=torch.float64,
                                   device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i >= args.warmup:
                times[which].append(elapsed.item())
    runs = [run for _, run in steps]
    steps = run = None
    release(runs)
    free_memory(device, args.compile)
    return times


def pair_row(names: tuple[str, str], times: tuple[list[float], list[float]]) -> dict:
    a, b = times
    ratios = sorted(tb / ta for ta, tb in zip(a, b))
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    return {"A": names[0], "B": names[1], "A_ms": statistics.median(a) * 1e3, "B_ms": statistics.median(b) * 1e3,
            "B_over_A": statistics.median(ratios), "B_over_A_q1": quartiles[0], "B_over_A_q3": quartiles[2],
            "iterations": len(ratios)}


def _worker(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    device = init_rank(rank, args.nproc, port, "nccl" if args.device == "cuda" else "gloo", args.timeout_s)
    groups: dict = {}
    try:
        for pair in args.pairs:
            times = time_pair(pair, args, device, groups)
            if rank == 0:
                row = pair_row(pair, times)
                queue.put(row)
                print(f"{row['A']:>24} {row['A_ms']:8.2f} ms | {row['B']:>24} {row['B_ms']:8.2f} ms | "
                      f"B/A {row['B_over_A']:.3f} [{row['B_over_A_q1']:.3f}, {row['B_over_A_q3']:.3f}]", flush=True)
    finally:
        for group in groups.values():
            if group is not None:
                dist.destroy_process_group(group)
        dist.destroy_process_group()


def parse_pair(text: str) -> tuple[str, str]:
    names = text.split(":")
    if len(names) != 2:
        raise argparse.ArgumentTypeError(f"a pair is A:B, got {text!r}")
    return checked_variant(names[0]), checked_variant(names[1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=lambda s: [parse_pair(p) for p in s.split(",")],
                        default=[parse_pair(p) for p in DEFAULT_PAIRS], help="comma-separated A:B variant pairs")
    add_setup_args(parser)
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations (each steps A and B)")
    parser.add_argument("--iterations", type=int, default=12, help="timed iterations (each steps A and B)")
    parser.add_argument("--steps-per-turn", type=int, default=1,
                        help="back-to-back steps per variant per turn, timed together (1: every step synchronised)")
    args = parser.parse_args(argv)
    check_setup_args(parser, args)
    if args.steps_per_turn < 1:
        parser.error(f"--steps-per-turn must be at least 1, got {args.steps_per_turn}")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    return spawn_ranks(_worker, args, args.nproc, lambda rows: _write(rows, args))


def _write(rows: list[dict], args: argparse.Namespace) -> None:
    stem = f"ddp_paired_{run_label(args)}"
    notes = (f"{setup_description(args)}. Both variants of a pair resident at once, turns of {args.steps_per_turn} back-to-back step(s) "
             f"alternating A B / B A over {args.iterations} timed iterations after {args.warmup} warm-up ones; "
             "each turn starts on all ranks together and counts on the slowest, per step. "
             "B_over_A: median of per-iteration ratios (q1, q3 its quartiles); "
             "for single:X pairs, 1 / B_over_A is X's scaling efficiency.")
    write_results(stem, rows, title="Data-parallel variants, paired A/B step times", notes=notes, out_dir=args.out_dir)


if __name__ == "__main__":
    main()
