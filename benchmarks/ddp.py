"""Data-parallel training benchmark: ``python -m benchmarks.ddp [--variants A,B,... | --pairs A:B,...]``.

Trains a TransformerLM (default xl, batch 4 per rank, context 512, bf16 autocast, AdamW, fused on CUDA) in
a plain PyTorch loop on ``--nproc`` spawned processes (no torchrun, no Trainer: the loop is the same for
every variant of ``benchmarks.ddp_variants``, so step times compare the gradient synchronisation alone).

``--variants`` visits one variant at a time, interleaved round by round, a fresh model each visit: step
time (median, slowest rank), the phases of separately synchronised steps, tokens/s, scaling efficiency
(single-rank step time / step time), peak memory and optimizer state per rank, whether the replicas
agree; ratios are taken within each round, then the median over rounds.

``--pairs`` times pairs A:B for ratios of a few percent, which step times drifting ±20% within minutes on
the lent GPU hosts swamp between visits: both variants live on the GPUs at once and their steps
alternate (A B, B A, ...) in turns of ``--steps-per-turn`` back-to-back steps, each turn started on all
ranks together (a barrier) and timed on the slowest. B_over_A is the median over iterations of B's time
per step over the adjacent A's, so slower drift cancels; for ``single:X``, 1 / B_over_A is X's scaling.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from typing import Iterator

import torch
import torch.distributed as dist

from benchmarks.ddp_variants import Run, Variant, build, checked_variant, make_step
from benchmarks.device import add_device_arg, free_memory, reset_peak_memory, synchronize, timed
from benchmarks.ranks import spawn_ranks
from benchmarks.report import argument_parser, bar_plot, write_results
from lm_systems.attention import attention_names
from lm_systems.model.config import ModelConfig
from lm_systems.parallel import gradient_process_group

GB = 1e9
DEFAULT_VARIANTS = ["single", "torch_ddp", "naive", "overlap", "bucketed_25", "bucketed_1000", "zero1"]
PHASES = ("forward", "backward", "sync", "optimizer")


def _rank(args: argparse.Namespace, device: torch.device) -> Iterator[dict]:
    """This rank's part: every visit or pair in turn; each row on every rank."""
    config = ModelConfig.from_name(
        args.size, context_length=args.context_length, attention=args.attention, vocab_size=args.vocab_size
    )
    g = torch.Generator(device=device).manual_seed(1000 + dist.get_rank())
    batch = torch.randint(0, config.vocab_size, (args.batch_size, args.context_length + 1), device=device, generator=g)
    names = [name for pair in args.pairs for name in pair] if args.pairs else args.variants
    hp_group = None  # the default group on gloo too
    if any(Variant.parse(name).high_priority for name in names):
        hp_group = gradient_process_group(high_priority=True)

    def build_here(name: str) -> Run | None:
        """``name`` on this rank; None where it does not run (``single`` beyond rank 0)."""
        variant = Variant.parse(name)
        if variant.base == "single" and dist.get_rank() != 0:
            return None
        return build(variant, config, device, hp_group if variant.high_priority else None)

    if args.pairs:
        for pair in args.pairs:
            free_memory(device)
            yield pair_row(pair, time_pair([build_here(name) for name in pair], batch, args))
        return
    for round_ in range(args.rounds):
        for name in args.variants:
            free_memory(device)
            reset_peak_memory(device)
            held_before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            run = build_here(name)
            result = measure(run, batch, args, held_before) if run is not None else None
            run = None  # the next visit's free_memory gives its memory back
            yield {"round": round_, "variant": name, **visit_row(result, args)}


def measure(run: Run, batch: torch.Tensor, args: argparse.Namespace, held_before: int) -> dict:
    """Warm-up, timed steps and phase-timed steps of ``run`` on this rank; its peak memory above
    ``held_before``, the bytes allocated before it was built (what an earlier visit left is not its own)."""
    device = batch.device
    step = make_step(run, device)
    for _ in range(args.warmup):
        step(batch)
    step_times = [timed(lambda: step(batch), device) for _ in range(args.steps)]
    phases: dict[str, list[float]] = {name: [] for name in PHASES}
    for _ in range(args.instrumented_steps):
        synchronize(device)
        marks = [time.perf_counter()]
        step(batch, lambda marks=marks: (synchronize(device), marks.append(time.perf_counter())))
        for name, (a, b) in zip(PHASES, itertools.pairwise(marks), strict=True):
            phases[name].append(b - a)
    run.close()
    state = run.optimizer.state  # a ShardedOptimizer's is its shard's
    return {
        "step_s": statistics.median(step_times),
        **{f"{k}_s": statistics.median(v) if v else float("nan") for k, v in phases.items()},
        "peak_mem": torch.cuda.max_memory_allocated(device) - held_before if device.type == "cuda" else float("nan"),
        "opt_state": sum(
            v.numel() * v.element_size() for s in state.values() for v in s.values() if isinstance(v, torch.Tensor)
        ),
        "checksum": sum(p.detach().double().sum().item() for p in run.optimizer.param_groups[0]["params"]),
    }


def visit_row(result: dict | None, args: argparse.Namespace) -> dict:
    """A visit's row from every rank's ``result`` (None where it did not run): slowest time, largest memory."""
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, result)
    ranks = [r for r in per_rank if r is not None]
    step_s = max(r["step_s"] for r in ranks)
    return {
        "nproc": len(ranks),
        "step_ms": step_s * 1e3,
        **{f"{k}_ms": max(r[f"{k}_s"] for r in ranks) * 1e3 for k in PHASES},
        "tokens_per_s": len(ranks) * args.batch_size * args.context_length / step_s,
        "peak_mem_GB": max(r["peak_mem"] for r in ranks) / GB,
        "opt_state_GB": max(r["opt_state"] for r in ranks) / GB,
        "replicas_equal": len({r["checksum"] for r in ranks}) == 1,
    }


def time_pair(runs: list[Run | None], batch: torch.Tensor, args: argparse.Namespace) -> tuple[list, list]:
    """Per-step seconds of each turn of the two runs on the slowest rank, alternating A B, B A, ..."""
    steps = [make_step(run, batch.device) if run is not None else None for run in runs]
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(args.warmup + args.iterations):
        for which in (0, 1) if i % 2 == 0 else (1, 0):
            dist.barrier()
            turn = [steps[which]] * args.steps_per_turn if steps[which] is not None else []
            seconds = timed(lambda turn=turn: [step(batch) for step in turn], batch.device)
            elapsed = torch.tensor([seconds / args.steps_per_turn], dtype=torch.float64, device=batch.device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i >= args.warmup:
                times[which].append(elapsed.item())
    for run in runs:
        if run is not None:
            run.close()
    return times


def pair_row(names: tuple[str, str], times: tuple[list[float], list[float]]) -> dict:
    a, b = times
    ratios = sorted(tb / ta for ta, tb in zip(a, b, strict=True))
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    return {
        "A": names[0],
        "B": names[1],
        "A_ms": statistics.median(a) * 1e3,
        "B_ms": statistics.median(b) * 1e3,
        "B_over_A": statistics.median(ratios),
        "B_over_A_q1": quartiles[0],
        "B_over_A_q3": quartiles[2],
        "iterations": len(ratios),
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
        for column, other, ratio in (
            (f"vs_{baseline}", baseline, lambda mine, other: mine / other),
            ("scaling_eff", "single", lambda mine, other: other / mine),
        ):
            ratios = [ratio(r["step_ms"], step_ms[(r["round"], other)]) for r in mine if (r["round"], other) in step_ms]
            out[column] = statistics.median(ratios) if ratios else float("nan")
        out["replicas_equal"] = all(r["replicas_equal"] for r in mine)
        out["rounds"] = len(mine)
        summary.append(out)
    return summary


def zero1_memory_note(summary: list[dict], nproc: int) -> str:
    """zero1's peak-memory saving against bucketed_25, and its target: 90% of the ideal."""
    by_name = {r["variant"]: r for r in summary}
    if "zero1" not in by_name or "bucketed_25" not in by_name:
        return ""
    zero, ddp = by_name["zero1"], by_name["bucketed_25"]
    saved, target = ddp["peak_mem_GB"] - zero["peak_mem_GB"], 0.9 * (1 - 1 / nproc) * ddp["opt_state_GB"]
    return (
        f"- zero1 vs bucketed_25: peak memory {saved:.2f} GB lower per rank; target ≥ 0.9·(1−1/N)·"
        f"{ddp['opt_state_GB']:.2f} GB optimizer state = {target:.2f} GB "
        f"({'met' if saved >= target else 'missed'}); step time ×{zero['step_ms'] / ddp['step_ms']:.3f}"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argument_parser(__doc__)
    runs = parser.add_mutually_exclusive_group()
    runs.add_argument(
        "--variants",
        type=lambda s: [checked_variant(v) for v in s.split(",")],
        default=DEFAULT_VARIANTS,
        help="comma-separated, visited one at a time (see ddp_variants)",
    )
    runs.add_argument("--pairs", type=lambda s: [_pair(p) for p in s.split(",")], help="comma-separated A:B pairs")
    parser.add_argument("--size", default="xl", help="model size (tiny, small, medium, large, xl, 2.7b)")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--context-length", type=int, default=512)
    parser.add_argument("--vocab-size", type=int, default=None, help="default: the size's (10,000)")
    parser.add_argument("--attention", default="sdpa", choices=attention_names(), help="the model's attention")
    add_device_arg(parser)
    parser.add_argument("--nproc", type=int, default=None, help="one per GPU (default: all GPUs, or 2 on CPU)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per visit, or iterations per pair")
    parser.add_argument("--rounds", type=int, default=2, help="--variants: interleaved rounds over the variants")
    parser.add_argument("--steps", type=int, default=8, help="--variants: timed steps per visit")
    parser.add_argument("--instrumented-steps", type=int, default=2, help="--variants: steps timed phase by phase")
    parser.add_argument("--iterations", type=int, default=12, help="--pairs: timed iterations (each steps A and B)")
    parser.add_argument("--steps-per-turn", type=int, default=1, help="--pairs: back-to-back steps per turn")
    args = parser.parse_args(argv)
    gpus = torch.cuda.device_count() if args.device.type == "cuda" else 0
    if args.nproc is None:
        args.nproc = gpus or 2
    if args.device.type == "cuda" and args.nproc > gpus:
        parser.error(f"--nproc {args.nproc} needs that many GPUs; {gpus} visible")
    if args.nproc < 2:
        parser.error("--nproc must be at least 2 (the single-GPU baseline runs inside the same job)")
    if args.steps_per_turn < 1:
        parser.error(f"--steps-per-turn must be at least 1, got {args.steps_per_turn}")
    return args


def _pair(text: str) -> tuple[str, str]:
    names = text.split(":")
    if len(names) != 2:
        raise argparse.ArgumentTypeError(f"a pair is A:B, got {text!r}")
    return checked_variant(names[0]), checked_variant(names[1])


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark; returns its rows (with --variants, per round: the file holds their summary)."""
    args = parse_args(argv)
    backend = "nccl" if args.device.type == "cuda" else "gloo"
    return spawn_ranks(_rank, args, args.nproc, backend, lambda rows: write(rows, args))


def write(rows: list[dict], args: argparse.Namespace) -> None:
    label = f"{args.size}_{args.nproc}{'gpu' if args.device.type == 'cuda' else 'cpu'}"
    setup = (
        f"{args.size}, batch {args.batch_size}/rank, context {args.context_length}, bf16-mixed, "
        f"{args.attention} attention"
    )
    if args.pairs:
        notes = (
            f"{setup}. Both variants of a pair resident at once, turns of {args.steps_per_turn} back-to-back "
            f"step(s) alternating A B / B A over {args.iterations} timed iterations after {args.warmup} warm-up "
            "ones; each turn starts on all ranks together and counts on the slowest, per step. "
            "B_over_A: median of per-iteration ratios (q1, q3 its quartiles); "
            "for single:X pairs, 1 / B_over_A is X's scaling efficiency."
        )
        write_results(
            f"ddp_paired_{label}", rows, "Data-parallel variants, paired A/B step times", notes, out_dir=args.out_dir
        )
        return
    setup += f", {'fused ' if args.device.type == 'cuda' else ''}AdamW, {args.nproc} processes"
    summary = summarize(rows)
    notes = (
        "Plain PyTorch loop, processes started by torch.multiprocessing.spawn (no torchrun, no Trainer); "
        f"variants interleaved over {args.rounds} rounds, a fresh model per visit; {args.warmup} warm-up, "
        f"{args.steps} timed steps (median, slowest rank), {args.instrumented_steps} phase-instrumented steps. "
        "sync_ms: gradient averaging left after backward (torch DDP waits inside backward, so 0 there). "
        "scaling_eff: single-rank step time / step time. vs_torch_ddp: step-time ratio in the same round. "
        "peak_mem_GB: the visit's peak allocation above what was allocated when it started.\n\n"
        + zero1_memory_note(summary, args.nproc)
    )
    columns = [
        "variant",
        "nproc",
        "step_ms",
        "vs_torch_ddp",
        "scaling_eff",
        "tokens_per_s",
        *(f"{p}_ms" for p in PHASES),
        "peak_mem_GB",
        "opt_state_GB",
        "replicas_equal",
        "rounds",
    ]
    write_results(
        f"ddp_{label}",
        summary,
        f"Data-parallel strategies: {setup}",
        notes,
        columns,
        bar_plot(summary, "variant", "step_ms", setup),
        args.out_dir,
    )


if __name__ == "__main__":
    main()
