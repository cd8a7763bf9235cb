"""Training speed through train.py's own path against a plain PyTorch loop: ``python -m lm_systems.bench.train``.

Both train the same TransformerLM on the same LMDataModule batches, with the same fused AdamW, schedule,
gradient clipping and precision, in one process and interleaved (the order alternates each round), so
the drift of a lent GPU's speed falls on both alike. ``train.py``'s path is ``lm_systems.cli.main``
with the Trainer, LitLM, LMDataModule, default callbacks and logger it builds; only its checkpoint
saves are turned off (this times training steps, not saves), as is validation. The plain loop is
what one writes by hand: autocast, ``backward``, ``clip_grad_norm_``, ``step``, ``zero_grad``.

Each run trains ``--warmup`` untimed steps, then ``--steps`` steps between two device synchronisations.
The table gives each path's median step time over the rounds, tokens/s, MFU and peak memory, and the
ratio train.py / plain loop (median of the per-round ratios, with its range), rewritten after every pair
of runs so that a run cut short keeps what it measured.

    python -m lm_systems.bench.train                                       # xl: ctx 512 × 4, ctx 2048 × 1
    python -m lm_systems.bench.train --shapes 1024x8 --attention sdpa --compile on
    python -m lm_systems.bench.train --size tiny --shapes 64x4 --rounds 1 --steps 3 --warmup 2 --device cpu  # CPU check
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import tempfile
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, Trainer

from lm_systems.attention import attention_names
from lm_systems.bench.device import add_device_arg, free_memory, peak_memory_gib, reset_peak_memory, synchronize, timed
from lm_systems.bench.report import argument_parser, write_results
from lm_systems.cli import main as train_py
from lm_systems.config import MODEL_SIZES, ModelConfig
from lm_systems.data.datamodule import LMDataModule
from lm_systems.hardware import peak_flops
from lm_systems.model import TransformerLM
from lm_systems.optim import adamw_param_groups, make_adamw
from lm_systems.schedule import warmup_cosine

PATHS = ("train_py", "plain")
PRECISIONS = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "32-true": torch.float32}
# One optimisation recipe for both paths, passed to train.py explicitly.
LR, WARMUP_STEPS, MIN_LR_RATIO, WEIGHT_DECAY, BETAS, CLIP = 3e-4, 5, 0.1, 0.1, (0.9, 0.95), 1.0


@dataclass(frozen=True)
class Setup:
    """One configuration both paths train."""

    size: str
    context: int
    batch_size: int
    precision: str
    attention: str
    compile: bool

    @property
    def label(self) -> str:
        return (f"{self.size} ctx{self.context}×{self.batch_size} {self.precision} {self.attention}"
                f"{' compiled' if self.compile else ''}")


@dataclass
class Measurement:
    ms_per_step: float
    peak_gib: float


# -- train.py's path -------------------------------------------------------------------------


class _StepClock(Callback):
    """Reads the clock after optimizer steps ``warmup`` and ``warmup + steps``, each after a device sync."""

    def __init__(self, warmup: int, steps: int) -> None:
        self._marks = {warmup: "start", warmup + steps: "end"}
        self._times: dict[str, float] = {}
        self.steps = steps

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        reset_peak_memory(trainer.strategy.root_device)

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        mark = self._marks.get(trainer.global_step)
        if mark is not None and mark not in self._times:
            synchronize(trainer.strategy.root_device)
            self._times[mark] = time.perf_counter()

    def measurement(self, device: torch.device) -> Measurement:
        elapsed = self._times["end"] - self._times["start"]
        return Measurement(1e3 * elapsed / self.steps, peak_memory_gib(device))


def train_py_args(setup: Setup, max_steps: int, workdir: Path, device: torch.device) -> list[str]:
    """The command line a user would give train.py for ``setup`` on ``device`` (validation off)."""
    return [
        "--accelerator", "gpu" if device.type == "cuda" else "cpu",
        "--model.size", setup.size, "--model.context_length", str(setup.context),
        "--model.attention", setup.attention, "--model.compile", str(setup.compile).lower(),
        "--model.lr", str(LR), "--model.warmup_steps", str(WARMUP_STEPS), "--model.min_lr_ratio", str(MIN_LR_RATIO),
        "--model.weight_decay", str(WEIGHT_DECAY), "--model.betas", f"[{BETAS[0]}, {BETAS[1]}]",
        "--model.sample_prompt", "",
        "--data.batch_size", str(setup.batch_size),
        "--precision", setup.precision, "--max_steps", str(max_steps),
        "--trainer.gradient_clip_val", str(CLIP), "--trainer.limit_val_batches", "0",
        "--trainer.enable_checkpointing", "false",
        "--trainer.logger.init_args.save_dir", str(workdir),
    ]


def run_train_py(setup: Setup, warmup: int, steps: int, workdir: Path, device: torch.device,
                 extra_flags: list[str]) -> Measurement:
    with warnings.catch_warnings():  # that args and the bench's own sys.argv both exist is intended here
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        cli = train_py([*train_py_args(setup, warmup + steps, workdir, device), *extra_flags], run=False)
    trainer = cli.trainer
    clock = _StepClock(warmup, steps)
    trainer.callbacks.append(clock)
    trainer.fit(cli.model, datamodule=cli.datamodule)
    return clock.measurement(trainer.strategy.root_device)


# -- the plain loop --------------------------------------------------------------------------


def run_plain(setup: Setup, warmup: int, steps: int, data: LMDataModule, device: torch.device) -> Measurement:
    config = ModelConfig.from_name(setup.size, context_length=setup.context, attention=setup.attention,
                                   vocab_size=data.vocab_size)
    with torch.device(device):
        model = TransformerLM(config)
    if setup.compile:
        model.compile()  # the whole model, as one compiles a hand-written loop
    optimizer = make_adamw(adamw_param_groups(model, WEIGHT_DECAY), LR, BETAS)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, WARMUP_STEPS, warmup + steps, MIN_LR_RATIO))
    dtype = PRECISIONS[setup.precision]
    autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else nullcontext()
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
    batches: Iterator[torch.Tensor] = iter(data.train_dataloader())

    def train_step() -> None:
        batch = next(batches).to(device, non_blocking=True)  # (B, T + 1)
        with autocast:
            logits = model(batch[:, :-1])  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        if scaler is None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            scaler.step(optimizer)
            scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

    reset_peak_memory(device)
    for _ in range(warmup):
        train_step()
    seconds = timed(lambda: [train_step() for _ in range(steps)], device)
    return Measurement(1e3 * seconds / steps, peak_memory_gib(device))


# -- the comparison --------------------------------------------------------------------------


def flops_per_token(setup: Setup, vocab_size: int) -> float:
    config = ModelConfig.from_name(setup.size, context_length=setup.context, vocab_size=vocab_size)
    with torch.device("meta"):
        return TransformerLM(config).flops_per_token(setup.context)


def summary_rows(setup: Setup, runs: dict[str, list[Measurement]], vocab_size: int,
                 device: torch.device) -> list[dict]:
    tokens = setup.batch_size * setup.context
    peak = peak_flops(device, PRECISIONS[setup.precision])
    flops = flops_per_token(setup, vocab_size)
    rows = []
    for path, measured in runs.items():
        ms = statistics.median(m.ms_per_step for m in measured)
        rows.append({
            "setup": setup.label, "path": path, "rounds": len(measured), "ms_per_step": ms,
            "min_ms": min(m.ms_per_step for m in measured), "max_ms": max(m.ms_per_step for m in measured),
            "tokens_per_s": tokens / ms * 1e3,
            "mfu": flops * tokens / (ms * 1e-3) / peak if peak else "",
            "peak_GiB": max(m.peak_gib for m in measured),
        })
    ratios = [a.ms_per_step / b.ms_per_step for a, b in zip(runs["train_py"], runs["plain"])]
    memory = max(m.peak_gib for m in runs["train_py"]) / max(m.peak_gib for m in runs["plain"])
    rows.append({
        "setup": setup.label, "path": "train_py / plain", "rounds": len(ratios),
        "ms_per_step": statistics.median(ratios), "min_ms": min(ratios), "max_ms": max(ratios),
        "peak_GiB": memory,
    })
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
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=[(512, 4), (2048, 1)],
                        metavar="CONTEXTxBATCH", help="context length × batch size per GPU (default: 512x4 2048x1)")
    parser.add_argument("--precision", default="bf16-mixed", choices=sorted(PRECISIONS))
    parser.add_argument("--attention", nargs="+", choices=attention_names(),
                        help="attention implementations to compare (default: sdpa flash_triton; sdpa on the CPU)")
    parser.add_argument("--compile", nargs="+", choices=("off", "on"), default=["off", "on"],
                        help="eager (off), torch.compiled (on), or both (default)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each trains every setup once per path)")
    parser.add_argument("--warmup", type=int, default=8, help="untimed optimizer steps per run")
    parser.add_argument("--steps", type=int, default=12, help="timed optimizer steps per run")
    parser.add_argument("--time-budget-s", type=float, default=None,
                        help="start no new round after this many seconds (the rounds done are reported)")
    parser.add_argument("--name", default="train_step", help="results file name (without extension)")
    parser.add_argument("--train-py-flags", type=shlex.split, default=[],
                        help="more train.py flags for its path, in one string, e.g. '--trainer.enable_progress_bar false'")
    add_device_arg(parser)
    args = parser.parse_args(argv)
    args.attention = args.attention or (["sdpa", "flash_triton"] if args.device.type == "cuda" else ["sdpa"])
    for flag in ("rounds", "warmup", "steps"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = args.device
    setups = [Setup(args.size, context, batch, args.precision, attention, mode == "on")
              for context, batch in args.shapes for mode in args.compile for attention in args.attention]
    runs: dict[Setup, dict[str, list[Measurement]]] = {setup: {path: [] for path in PATHS} for setup in setups}
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_train_") as workdir:
        for round_index in range(args.rounds):
            if args.time_budget_s is not None and round_index and time.perf_counter() - began > args.time_budget_s:
                print(f"time budget reached: {round_index} rounds done")
                break
            for setup in setups:
                data = LMDataModule(context_length=setup.context, batch_size=setup.batch_size)
                data.prepare_data()
                order = PATHS if round_index % 2 == 0 else PATHS[::-1]
                for path in order:
                    measured = (run_train_py(setup, args.warmup, args.steps, Path(workdir), device, args.train_py_flags)
                                if path == "train_py" else run_plain(setup, args.warmup, args.steps, data, device))
                    runs[setup][path].append(measured)
                    print(f"round {round_index} {setup.label} {path}: {measured.ms_per_step:.1f} ms/step, "
                          f"{measured.peak_gib:.1f} GiB", flush=True)
                    free_memory(device)
                write(runs, args)  # after every pair of runs: a run cut short keeps what it measured


def write(runs: dict[Setup, dict[str, list[Measurement]]], args: argparse.Namespace) -> None:
    """The summary of every setup both paths have trained, as results files."""
    vocab_size = LMDataModule().vocab_size
    rows = [row for setup, measured in runs.items() if measured["train_py"] and measured["plain"]
            for row in summary_rows(setup, measured, vocab_size, args.device)]
    flags = f" train.py's extra flags: `{shlex.join(args.train_py_flags)}`." if args.train_py_flags else ""
    notes = (f"Each run: {args.warmup} untimed then {args.steps} timed optimizer steps; AdamW (fused on CUDA) lr {LR}, "
             f"clip {CLIP}, same batches. `train_py / plain` rows: the median per-round ratio of step times "
             f"(min_ms/max_ms: its range) and the ratio of peak memory.{flags}")
    write_results(args.name, rows, "Training step: train.py's path against a plain PyTorch loop", notes=notes,
                  out_dir=args.out_dir)


if __name__ == "__main__":
    main()
