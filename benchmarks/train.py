"""Training speed through train.py's own path against a plain PyTorch loop: ``python -m benchmarks.train``.

Both train the same TransformerLM on the same LMDataModule batches, with the same fused AdamW, schedule,
gradient clipping and precision. ``train.py``'s path is its ``main`` with the Trainer, LitLM,
LMDataModule, default callbacks and logger it builds; only its checkpoint saves are turned off (this times
training steps, not saves), as is validation. The plain loop is what one writes by hand: autocast,
``backward``, ``clip_grad_norm_``, ``step``, ``zero_grad``, over a model of its own.

The two alternate in one process, in segments of ``--steps`` optimizer steps: after ``--warmup`` steps,
train.py's fit pauses at the end of every segment while the plain loop trains a segment of its own (once
per attention in ``--attention``, the one train.py runs first), each segment timed between two device
synchronisations. A lent GPU's speed drifts by tens of percent over minutes; segments seconds apart see
the same GPU, and each path compiles once. Both models are held at once: xl at context 1024 × 8 needs
a GPU of more than 80 GB. On a GPU each setup runs in a process of its own, which starts with the whole
GPU's memory and no compiled graphs.

The table gives each path's median segment time per step, tokens/s, MFU and peak memory (each path's
own: the other's resident memory taken off), the ratio train.py / plain loop (median of the per-segment
ratios, with their range), and each attention's plain step against the first's. It is rewritten after
every segment, so that a run cut short keeps what it measured.

    python -m benchmarks.train                                       # xl: ctx 512 × 4, ctx 2048 × 1
    python -m benchmarks.train --shapes 2048x1 --attention sdpa flash_triton --compile on
    python -m benchmarks.train --size tiny --shapes 64x4 --rounds 2 --steps 3 --warmup 2 --device cpu  # CPU check
"""

from __future__ import annotations

import argparse
import contextvars
import queue
import shlex
import statistics
import tempfile
import warnings
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.device import (
    add_device_arg,
    free_memory,
)
from benchmarks.report import argument_parser, write_results
from benchmarks.train_py_command import CLIP, LR, TrainPyRun
from benchmarks.train_py_command import train_py_args as user_train_py_args
from benchmarks.train_vs_plain import PRECISIONS, Interleave, PlainLoop, Rounds, Setup
from lm_systems.attention import attention_names
from lm_systems.data.datamodule import LMDataModule
from lm_systems.model.config import MODEL_SIZES, ModelConfig
from lm_systems.model.transformer import TransformerLM
from lm_systems.profiling.hardware import peak_flops
from train import main as train_py


def train_py_args(setup: Setup, max_steps: int, workdir: Path, device: torch.device) -> list[str]:
    """The command line a user would give train.py for ``setup`` on ``device`` (validation off)."""
    accelerator = "gpu" if device.type == "cuda" else "cpu"
    run = TrainPyRun(
        accelerator,
        setup.size,
        setup.context,
        setup.batch_size,
        setup.precision,
        setup.attention,
        setup.compile,
        max_steps,
        workdir,
    )
    return user_train_py_args(run)


def run_setup(setup: Setup, args: argparse.Namespace, workdir: Path, on_round: Callable[[Rounds], None]) -> None:
    """train.py and the plain loop on ``setup``, interleaved for ``args.rounds`` segments of ``args.steps`` steps;
    the plain loop also in each other attention of ``args.attention``. ``on_round`` gets the rounds after each."""
    total = args.warmup + args.rounds * args.steps
    with warnings.catch_warnings():  # that args and the bench's own sys.argv both exist is intended here
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        cli = train_py([*train_py_args(setup, total, workdir, args.device), *args.train_py_flags], run=False)
    plain_data = LMDataModule(context_length=setup.context, batch_size=setup.batch_size)
    plain_data.prepare_data()
    order = [setup.attention, *(name for name in args.attention if name != setup.attention)]
    measured = Rounds()
    interleave = Interleave(
        lambda: PlainLoop(setup, plain_data, args.device, total),
        order,
        args.warmup,
        args.steps,
        measured,
        lambda: on_round(measured),
    )
    cli.trainer.callbacks.append(interleave)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)


def run_setup_here(setup: Setup, args: argparse.Namespace, workdir: Path, on_round: Callable[[Rounds], None]) -> None:
    """``run_setup`` in this process, leaving nothing of the setup behind."""
    torch._dynamo.reset()  # a compiled setup starts afresh: a second shape would get a dynamic-shape graph
    # In a context of its own: the CLI's parser, left in a context variable, would keep the models alive.
    contextvars.copy_context().run(run_setup, setup, args, workdir, on_round)
    free_memory(args.device)


def run_setup_in_own_process(
    setup: Setup, args: argparse.Namespace, workdir: Path, on_round: Callable[[Rounds], None]
) -> None:
    """``run_setup`` in a spawned process, which starts with the whole GPU; its rounds come back as each ends."""
    context = torch.multiprocessing.get_context("spawn")
    rounds_queue = context.Queue()
    process = context.Process(target=_run_and_send, args=(setup, args, workdir, rounds_queue), daemon=True)
    process.start()
    while True:
        try:
            rounds = rounds_queue.get(timeout=5)
        except queue.Empty:
            if process.is_alive():
                continue
            break
        if rounds is None:  # the setup is done
            break
        on_round(rounds)
    process.join()
    if process.exitcode:
        raise RuntimeError(
            f"{setup.label} failed in its process (exit code {process.exitcode}): its error is "
            "printed above; the rounds it finished are in the results"
        )


def _run_and_send(setup: Setup, args: argparse.Namespace, workdir: Path, rounds_queue: Any) -> None:
    run_setup(setup, args, workdir, rounds_queue.put)
    rounds_queue.put(None)


# -- the report ------------------------------------------------------------------------------


def flops_per_token(setup: Setup, vocab_size: int) -> float:
    config = ModelConfig.from_name(setup.size, context_length=setup.context, vocab_size=vocab_size)
    with torch.device("meta"):
        return TransformerLM(config).flops_per_token(setup.context)


def _median_row(label: str, path: str, values: list[float], **columns: Any) -> dict:
    """A table row: the median of per-segment ``values`` with their range, then ``columns``."""
    return {
        "setup": label,
        "path": path,
        "rounds": len(values),
        "ms_per_step": statistics.median(values),
        "min_ms": min(values),
        "max_ms": max(values),
        **columns,
    }


def summary_rows(setup: Setup, measured: Rounds, vocab_size: int, device: torch.device) -> list[dict]:
    tokens = setup.batch_size * setup.context
    peak = peak_flops(device, PRECISIONS[setup.precision])
    flops = flops_per_token(setup, vocab_size)
    runs = {"train_py": measured.train_py, "plain": measured.plain[setup.attention]}
    rows = []
    for path, segments in runs.items():
        ms = statistics.median(m.ms_per_step for m in segments)
        rows.append(
            _median_row(
                setup.label,
                path,
                [m.ms_per_step for m in segments],
                tokens_per_s=tokens / ms * 1e3,
                mfu=flops * tokens / (ms * 1e-3) / peak if peak else "",
                peak_GiB=max(m.peak_gib for m in segments),
            )
        )
    ratios = [a.ms_per_step / b.ms_per_step for a, b in zip(*runs.values(), strict=True)]
    memory = max(m.peak_gib for m in runs["train_py"]) / max(m.peak_gib for m in runs["plain"])
    return rows + [_median_row(setup.label, "train_py / plain", ratios, peak_GiB=memory)]


def attention_rows(setups: list[Setup], measured: dict[Setup, Rounds], attentions: list[str]) -> list[dict]:
    """Per shape: each other attention's plain step over the first's, segment by segment, from every setup's run."""
    first, rows = attentions[0], []
    for setup in (s for s in setups if s.attention == first):
        ratios: dict[str, list[float]] = defaultdict(list)
        for same_shape in (replace(setup, attention=name) for name in attentions):
            plain = measured[same_shape].plain if same_shape in measured else {}
            for name in attentions[1:]:
                ratios[name] += [
                    a.ms_per_step / b.ms_per_step
                    # strict=False: an attention that was not run at this shape has no segments, hence no ratios
                    for a, b in zip(plain.get(name, []), plain.get(first, []), strict=False)
                ]
        rows += [
            _median_row(setup.shape_label, f"plain {name} / {first}", values)
            for name, values in ratios.items()
            if values
        ]
    return rows


def parse_shape(text: str) -> tuple[int, int]:
    """``CONTEXTxBATCH`` such as ``512x4``."""
    try:
        context, batch = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shapes takes CONTEXTxBATCH such as 512x4, got {text!r}") from None
    if context <= 0 or batch <= 0:
        raise argparse.ArgumentTypeError(f"--shapes needs positive sizes, got {text!r}")
    return context, batch


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argument_parser(__doc__)
    parser.add_argument("--size", default="xl", choices=sorted(MODEL_SIZES))
    parser.add_argument(
        "--shapes",
        nargs="+",
        type=parse_shape,
        default=[(512, 4), (2048, 1)],
        metavar="CONTEXTxBATCH",
        help="context length × batch size per GPU (default: 512x4 2048x1)",
    )
    parser.add_argument("--precision", default="bf16-mixed", choices=sorted(PRECISIONS))
    parser.add_argument(
        "--attention",
        nargs="+",
        choices=attention_names(),
        help="attention implementations to compare (default: sdpa flash_triton; sdpa on the CPU)",
    )
    parser.add_argument(
        "--compile",
        nargs="+",
        choices=("off", "on"),
        default=["off", "on"],
        help="eager (off), torch.compiled (on), or both (default)",
    )
    parser.add_argument("--rounds", type=int, default=6, help="segments each path trains per setup")
    parser.add_argument("--warmup", type=int, default=10, help="untimed optimizer steps of each path first")
    parser.add_argument(
        "--steps",
        type=int,
        default=10,
        help="optimizer steps per timed segment (a multiple of train.py's log_every_n_steps, 10, "
        "keeps its logged steps in proportion)",
    )
    parser.add_argument("--name", default="train_step", help="results file name (without extension)")
    parser.add_argument(
        "--train-py-flags",
        type=shlex.split,
        default=[],
        help="more train.py flags for its path, in one string, e.g. '--trainer.enable_progress_bar false'",
    )
    add_device_arg(parser)
    args = parser.parse_args(argv)
    args.attention = args.attention or (["sdpa", "flash_triton"] if args.device.type == "cuda" else ["sdpa"])
    for flag in ("rounds", "warmup", "steps"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setups = [
        Setup(args.size, context, batch, args.precision, attention, mode == "on")
        for context, batch in args.shapes
        for mode in args.compile
        for attention in args.attention
    ]
    measured: dict[Setup, Rounds] = {}
    # On a GPU each setup runs in a process of its own, which starts with the whole GPU's memory and no compiled
    # graphs; on the CPU in this one.
    run = run_setup_in_own_process if args.device.type == "cuda" else run_setup_here
    with tempfile.TemporaryDirectory(prefix="bench_train_") as workdir:
        for setup in setups:

            def report(rounds: Rounds, setup: Setup = setup) -> None:
                print(
                    f"{setup.label} round {len(rounds.train_py)}: train_py {rounds.train_py[-1].ms_per_step:.1f} "
                    + " ".join(f"plain {name} {m[-1].ms_per_step:.1f}" for name, m in rounds.plain.items())
                    + " ms/step",
                    flush=True,
                )
                measured[setup] = rounds
                write(setups, measured, args)

            run(setup, args, Path(workdir), report)


def write(setups: list[Setup], measured: dict[Setup, Rounds], args: argparse.Namespace) -> None:
    """The summary of every setup measured so far, as results files."""
    vocab_size = LMDataModule().vocab_size
    rows = [
        row
        for setup in setups
        if setup in measured
        for row in summary_rows(setup, measured[setup], vocab_size, args.device)
    ]
    rows += attention_rows(setups, measured, args.attention)
    flags = f" train.py's extra flags: `{shlex.join(args.train_py_flags)}`." if args.train_py_flags else ""
    notes = (
        f"Each setup: one process, {args.warmup} untimed steps of each path, then segments of {args.steps} "
        f"optimizer steps, train.py's and the plain loop's in turn; AdamW (fused on CUDA) lr {LR}, clip {CLIP}. "
        "Ratio rows: the median per-segment ratio of step times (min_ms/max_ms: its range) and, for "
        f"train_py / plain, the ratio of peak memory.{flags}"
    )
    write_results(
        args.name,
        rows,
        "Training step: train.py's path against a plain PyTorch loop",
        notes=notes,
        out_dir=args.out_dir,
    )


if __name__ == "__main__":
    main()
