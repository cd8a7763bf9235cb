"""Data-parallel scaling through train.py: ``python -m benchmarks.scaling --devices 2``.

Every setup is ``python train.py ...`` in processes of its own, exactly as a user launches it (Lightning
starts the other ranks), with one more callback, ``WindowTimer``: after ``--warmup`` optimizer steps it
times ``--segments`` segments of ``--steps`` steps, synchronising the device only at segment boundaries
(so backward's overlap with communication is left alone), and writes each rank's segment times and peak
memory. A setup's step time is the median over its segments of the slowest rank's time.

Setups (``--setups``): ``single`` (one GPU, the baseline every scaling is taken against), and a strategy
name with an optional bucket size, init args and environment variables:

    ddp:100                 Lightning's ddp (torch DistributedDataParallel), bucket_cap_mb 100
    bucketed_ddp            this project's strategies at their defaults (also naive_ddp, overlap_ddp, zero1, zero3)
    zero1:100+exchange_stages=1     bucket_size_mb 100, and --trainer.strategy.exchange_stages 1
    bucketed_ddp@NCCL_MAX_CTAS=8    with that environment variable set for the run
    single+--model.compile=blocks   an option that starts with -- is a train.py flag of that setup's
    single+--model.attention=flash_triton   (with --devices 1 --baseline SPEC: one GPU, two train.py flags compared)
    fsdp2                   torch FSDP2 (fully_shard per block, bf16 parameters, fp32 gradient reduction)

With ``--trace-steps N``, each visit then traces N more steps on every rank (torch.profiler, the device's activity)
and ``NAME_timeline`` says where their time went: GPU compute, NCCL (exposed or beside compute), the GPU idle, the
host waiting for it (``benchmarks.gpu_timeline``); the traces stay in ``NAME_traces/`` (gzipped Chrome traces, one
per visit and rank, for Perfetto or ``python -m benchmarks.gpu_timeline``).

Configurations (``--configs``): ``CONTEXTxBATCH:compiled`` or ``:eager``, the batch per GPU. Rounds visit
every configuration's setups in turn, ``single`` first, so a scaling is taken against the one-GPU step of
the same round (the lent GPUs' speed drifts by tens of percent within minutes). The table is rewritten
after every run, so a call cut short keeps what it measured.

    python -m benchmarks.scaling --devices 2                                    # xl, the issue's two configs
    python -m benchmarks.scaling --configs 1024x8:compiled --setups single ddp:25 bucketed_ddp zero1
    python -m benchmarks.scaling --size tiny --configs 32x4:eager --accelerator cpu --warmup 2 --steps 2  # CPU
    python -m benchmarks.scaling --configs 512x4:eager --setups single zero3 --trace-steps 2   # host or link?
    python -m benchmarks.scaling --devices 1 --size medium --configs 8192x2:compiled --name long_context \
        --setups single+--model.attention=sdpa single+--model.attention=flash_triton \
        --baseline single+--model.attention=sdpa --rounds 3       # long context: flash_triton against sdpa
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from benchmarks import gpu_timeline
from benchmarks.report import argument_parser, write_results
from benchmarks.scaling_setups import Config, Setup
from benchmarks.train_py_command import CLIP, LR, REPO, TrainPyRun, train_py_command
from lm_systems.attention.tuning import CACHE_ENV
from lm_systems.model.config import MODEL_SIZES

TIMELINE_NOTES = (
    "--trace-steps steps after the timed segments, traced by torch.profiler (device activity) on "
    "each rank, per step: benchmarks/gpu_timeline.py says what each column counts."
)


@dataclass
class Run:
    """One setup's visit: per-segment step times (the slowest rank's), peak memory per rank."""

    config: Config
    setup: Setup
    round: int
    segment_ms: list[float] = field(default_factory=list)
    peak_GiB: list[float] = field(default_factory=list)
    timeline: list[dict[str, float]] = field(default_factory=list)  # per rank, with --trace-steps
    first_timed_s: float = float("nan")  # from the launch to the first timed step's start
    mfu: float | None = None  # model FLOPs of a step per GPU over the step time, per the device's dense peak
    error: str = ""

    @property
    def ms(self) -> float:
        return statistics.median(self.segment_ms) if self.segment_ms else float("nan")


def visit_command(config: Config, setup: Setup, args: argparse.Namespace, workdir: Path, timer_dir: Path) -> list[str]:
    """The user's command line for ``setup`` with the timer added (checkpoints, validation and sampling off)."""
    timer = {
        "class_path": "benchmarks.window_timer.WindowTimer",
        "init_args": {
            "out_dir": str(timer_dir),
            "warmup": args.warmup,
            "steps": args.steps,
            "segments": args.segments,
            "trace_steps": args.trace_steps,
        },
    }
    steps = args.warmup + args.steps * args.segments + args.trace_steps
    run = TrainPyRun(
        args.accelerator,
        args.size,
        config.context,
        config.batch_size,
        args.precision,
        args.attention,
        config.compile,
        steps,
        workdir / "logs",
    )
    return train_py_command(
        run,
        f"--trainer.callbacks+={json.dumps(timer)}",
        *args.train_py_flags,
        *setup.train_py_args(args.devices),  # a setup's own flags last: they win
    )


def run_in_own_group(command: list[str], env: dict[str, str], out: IO[str], timeout: float) -> int | None:
    """Run ``command`` in a process group of its own; its exit code, or None if it ran past ``timeout`` seconds.
    Then, or on Ctrl-C (which a new session does not receive), the whole group is killed: the ranks Lightning
    started beside it too, which would hold their GPUs."""
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def visit(config: Config, setup: Setup, round_: int, args: argparse.Namespace, workdir: Path) -> Run:
    """Run train.py for ``setup`` from the checkout (its data cache too); its segments, or the tail of its output
    if it failed."""
    run = Run(config, setup, round_)
    timer_dir = workdir / f"visit{len(list(workdir.glob('visit*.log')))}"
    command = visit_command(config, setup, args, workdir, timer_dir)
    env = {
        **os.environ,
        **dict(setup.env),
        **(cold_caches(workdir / f"{timer_dir.name}_caches") if args.cold_caches else {}),
    }
    log = timer_dir.with_suffix(".log")
    launched = time.time()
    with log.open("w") as out:
        code = run_in_own_group(command, env, out, args.run_timeout)
    records = [json.loads(path.read_text()) for path in sorted(timer_dir.glob("rank*.json"))]
    if code != 0 or not records:
        tail = log.read_text().strip().splitlines()[-15:]
        run.error = (
            f"stopped after --run-timeout {args.run_timeout:g} s"
            if code is None
            else f"exit {code}: {tail[-1] if tail else 'no output'}"
        )
        print(f"  {setup.spec} failed ({run.error}); its output ends:\n    " + "\n    ".join(tail), flush=True)
        return run
    run.segment_ms = [max(ms) for ms in zip(*(r["segment_ms"] for r in records), strict=True)]
    run.peak_GiB = [r["peak_GiB"] for r in sorted(records, key=lambda r: r["rank"])]
    run.first_timed_s = max(r["timed_from_unix"] for r in records) - launched
    run.mfu = model_flops_utilisation(records[0], run.ms)
    traces = sorted(
        timer_dir.glob("trace_rank*.json.gz"),
        key=lambda path: int(path.name.removeprefix("trace_rank").removesuffix(".json.gz")),
    )
    run.timeline = [gpu_timeline.summarize_file(path, args.trace_steps) for path in traces]
    keep_traces(run, traces, Path(args.out_dir) / f"{args.name}_traces")
    return run


def model_flops_utilisation(record: dict[str, Any], ms_per_step: float) -> float | None:
    """A rank's model FLOPs a step over the step's time and its device's dense peak; None where either is unknown."""
    if not record.get("flops_per_step") or not record.get("peak_flops"):
        return None
    return record["flops_per_step"] / (ms_per_step / 1e3) / record["peak_flops"]


def cold_caches(folder: Path) -> dict[str, str]:
    """Environment variables that point every compile and tuning cache of a run at a new, empty folder: Triton's
    kernels, Inductor's graphs and this project's kernel tuning, as on a machine that never ran it."""
    names = {"TRITON_CACHE_DIR": "triton", "TORCHINDUCTOR_CACHE_DIR": "inductor", CACHE_ENV: "tuning"}
    return {variable: str(folder / name) for variable, name in names.items()}


def keep_traces(run: Run, traces: list[Path], folder: Path) -> None:
    """Move a visit's traces to ``folder`` (one file per rank, named after the visit; Perfetto opens them)."""
    if not traces:
        return
    folder.mkdir(parents=True, exist_ok=True)
    visit_name = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{run.config.label}_{run.setup.spec}_round{run.round + 1}")
    for rank, trace in enumerate(traces):
        shutil.move(trace, folder / f"{visit_name}_rank{rank}.json.gz")


def baseline_spec(args: argparse.Namespace) -> str | None:
    """The setup over_baseline divides by: ``--baseline``, else torch DDP's (``ddp`` at 25 MB, or the first ``ddp``)."""
    if args.baseline:
        return args.baseline
    return next(
        (s.spec for s in args.setups if s.name == "ddp" and s.bucket_mb in (None, "25")),
        next((s.spec for s in args.setups if s.name == "ddp"), None),
    )


def rows(runs: list[Run], args: argparse.Namespace) -> list[dict]:
    """Per configuration and setup: the median over rounds of its step time, its scaling against the one-GPU step
    of the same round, and its step time over the baseline's in the same round (``baseline_spec``)."""
    table = []
    configs = list(dict.fromkeys(run.config for run in runs))
    base_spec = baseline_spec(args)
    for config in configs:
        visits = [run for run in runs if run.config == config]
        by_round = {(run.round, run.setup.spec): run for run in visits}

        def ratios(spec: str, base: str | None, by_round: dict = by_round) -> list[float]:
            pairs = [(by_round.get((r, spec)), by_round.get((r, base))) for r in range(args.rounds)]
            return [a.ms / b.ms for a, b in pairs if a and b and a.segment_ms and b.segment_ms]

        for setup in args.setups:
            mine = [run for run in visits if run.setup == setup]
            if not mine:
                continue
            done = [run for run in mine if run.segment_ms]
            devices = 1 if setup.name == "single" else args.devices
            row: dict[str, Any] = {"config": config.label, "setup": setup.spec, "devices": devices, "rounds": len(done)}
            if done:
                ms = statistics.median(run.ms for run in done)
                scaling = [1 / ratio for ratio in ratios(setup.spec, "single")]
                over_base = ratios(setup.spec, base_spec) if base_spec else []
                row.update(
                    ms_per_step=ms,
                    min_ms=min(run.ms for run in done),
                    max_ms=max(run.ms for run in done),
                    tokens_per_s=devices * config.batch_size * config.context / ms * 1e3,
                    scaling=statistics.median(scaling) if scaling else "",
                    over_baseline=statistics.median(over_base) if over_base else "",
                    peak_GiB_per_rank=max(max(run.peak_GiB) for run in done),
                    mfu=statistics.median(run.mfu for run in done) if all(run.mfu for run in done) else "",
                    first_timed_s=max(run.first_timed_s for run in done),
                )
            errors = [run.error for run in mine if run.error]
            row["error"] = errors[-1] if errors else ""
            table.append(row)
    return table


COLUMNS = [
    "config",
    "setup",
    "devices",
    "rounds",
    "ms_per_step",
    "min_ms",
    "max_ms",
    "tokens_per_s",
    "scaling",
    "over_baseline",
    "peak_GiB_per_rank",
    "mfu",
    "first_timed_s",
    "error",
]
TIMELINE_COLUMNS = ["config", "setup", "round", "rank", *gpu_timeline.COLUMNS]


def timeline_rows(runs: list[Run]) -> list[dict]:
    """Per visit and rank, where its traced steps' time went (``benchmarks.gpu_timeline``)."""
    return [
        {"config": run.config.label, "setup": run.setup.spec, "round": run.round + 1, "rank": rank, **summary}
        for run in runs
        for rank, summary in enumerate(run.timeline)
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argument_parser(__doc__)
    parser.add_argument("--devices", type=int, default=2, help="GPUs (processes) of the data-parallel setups")
    parser.add_argument("--size", default="xl", choices=sorted(MODEL_SIZES))
    parser.add_argument(
        "--configs",
        nargs="+",
        type=Config.parse,
        default=[Config(1024, 8, True), Config(512, 4, False)],
        help="CONTEXTxBATCH:compiled|eager, batch per GPU (default: 1024x8:compiled 512x4:eager)",
    )
    parser.add_argument(
        "--setups",
        nargs="+",
        type=Setup.parse,
        default=[
            Setup.parse(s)
            for s in ("single", "ddp:25", "ddp:100", "ddp:1000", "bucketed_ddp", "zero1", "zero3", "fsdp2")
        ],
        help="single, or strategy[:bucket_mb][+init_arg=value][@ENV=value] (default: single, ddp "
        "at 25/100/1000 MB, bucketed_ddp, zero1, zero3, fsdp2)",
    )
    parser.add_argument("--baseline", help="the setup over_baseline divides by (default: ddp at 25 MB)")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--accelerator", default="gpu", choices=("gpu", "cpu"))
    parser.add_argument("--rounds", type=int, default=1, help="visits of every setup, interleaved")
    parser.add_argument("--warmup", type=int, default=8, help="untimed optimizer steps first")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per timed segment")
    parser.add_argument("--segments", type=int, default=3, help="timed segments per visit")
    parser.add_argument("--run-timeout", type=float, default=900, help="seconds before a visit is stopped")
    parser.add_argument(
        "--trace-steps",
        type=int,
        default=0,
        help="after the timed segments, trace this many steps per rank with torch.profiler and "
        "write where their time went (NAME_timeline: GPU compute, NCCL, idle, host waits; "
        "the traces in NAME_traces/)",
    )
    parser.add_argument(
        "--cold-caches",
        action="store_true",
        help="every visit starts from empty Triton, Inductor and kernel-tuning caches (first_timed_s "
        "is then the time a new machine takes to its first timed step)",
    )
    parser.add_argument("--name", default="scaling", help="results file name (without extension)")
    parser.add_argument(
        "--train-py-flags", type=shlex.split, default=[], help="more train.py flags for every setup, in one string"
    )
    args = parser.parse_args(argv)
    for flag in ("devices", "rounds", "warmup", "steps", "segments"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    # The one-GPU step first in every round: each scaling is taken against the same round's.
    args.setups = sorted(dict.fromkeys(args.setups), key=lambda s: s.spec != "single")
    if args.trace_steps < 0:
        parser.error(f"--trace-steps must be 0 (no trace) or more, got {args.trace_steps}")
    if args.baseline and args.baseline not in [s.spec for s in args.setups]:
        parser.error(f"--baseline {args.baseline!r} is not one of the --setups")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    runs: list[Run] = []
    notes = (
        f"`python train.py` per setup ({args.size}, {args.precision}, attention {args.attention}, AdamW lr {LR}, "
        f"clip {CLIP}; checkpoints, validation and the closing sample off); {args.warmup} warm-up steps, then "
        f"{args.segments} segments of {args.steps} steps, the device synchronised only between segments. "
        "ms_per_step: median over rounds of each visit's median segment (the slowest rank's); scaling: the "
        "same round's one-GPU step over this one (median over rounds); over_baseline: this step over "
        f"{baseline_spec(args) or 'the baseline'}'s in the same round (median over rounds); peak_GiB_per_rank: "
        "the largest rank's allocator peak over the timed steps; mfu: the model's FLOPs a step per GPU (causal "
        "attention, recomputation not counted) over the step time and the device's dense peak; first_timed_s: "
        "seconds from the launch to the first timed step (the slowest visit)"
        f"{', every visit from empty compile and tuning caches' if args.cold_caches else ''}."
    )
    with tempfile.TemporaryDirectory(prefix="bench_scaling_") as tmp:
        workdir = Path(tmp)
        for round_ in range(args.rounds):
            for config in args.configs:
                for setup in args.setups:
                    print(f"round {round_ + 1}/{args.rounds} {config.label}: {setup.spec} ...", flush=True)
                    run = visit(config, setup, round_, args, workdir)
                    if run.segment_ms:
                        print(f"  {run.ms:.1f} ms/step, peak {max(run.peak_GiB):.1f} GiB", flush=True)
                    runs.append(run)
                    write_results(
                        args.name,
                        rows(runs, args),
                        "Data-parallel scaling through train.py",
                        notes=notes,
                        columns=COLUMNS,
                        out_dir=args.out_dir,
                    )
                    if run.timeline:
                        write_results(
                            f"{args.name}_timeline",
                            timeline_rows(runs),
                            "Where the traced steps' time went, per rank",
                            notes=TIMELINE_NOTES,
                            columns=TIMELINE_COLUMNS,
                            out_dir=args.out_dir,
                        )


if __name__ == "__main__":
    main()
