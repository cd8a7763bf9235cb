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
import time
import warnings
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, Trainer

from benchmarks.device import (
    add_device_arg,
    allocated_gib,
    free_memory,
    peak_memory_gib,
    reset_peak_memory,
    synchronize,
    timed,
)
from benchmarks.report import argument_parser, write_results
from lm_systems.attention import attention_names
from lm_systems.data.datamodule import LMDataModule
from lm_systems.model.config import MODEL_SIZES, ModelConfig
from lm_systems.model.transformer import CausalSelfAttention, TransformerLM
from lm_systems.profiling.hardware import peak_flops
from lm_systems.training.optim import adamw_param_groups, make_adamw
from lm_systems.training.schedule import warmup_cosine_schedule
from train import main as train_py

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
        return (
            f"{self.size} ctx{self.context}×{self.batch_size} {self.precision} {self.attention}"
            f"{' compiled' if self.compile else ''}"
        )

    @property
    def shape_label(self) -> str:
        return f"{self.size} ctx{self.context}×{self.batch_size} {self.precision}{' compiled' if self.compile else ''}"


@dataclass
class Measurement:
    ms_per_step: float
    peak_gib: float


@dataclass
class Rounds:
    """What one setup's runs measured, segment by segment."""

    train_py: list[Measurement] = field(default_factory=list)
    plain: dict[str, list[Measurement]] = field(default_factory=dict)  # per attention


def train_py_args(setup: Setup, max_steps: int, workdir: Path, device: torch.device) -> list[str]:
    """The command line a user would give train.py for ``setup`` on ``device`` (validation off)."""
    return [
        "--accelerator",
        "gpu" if device.type == "cuda" else "cpu",
        "--model.size",
        setup.size,
        "--model.context_length",
        str(setup.context),
        "--model.attention",
        setup.attention,
        "--model.compile",
        str(setup.compile).lower(),
        "--model.lr",
        str(LR),
        "--model.warmup_steps",
        str(WARMUP_STEPS),
        "--model.min_lr_ratio",
        str(MIN_LR_RATIO),
        "--model.weight_decay",
        str(WEIGHT_DECAY),
        "--model.betas",
        f"[{BETAS[0]}, {BETAS[1]}]",
        "--model.sample_prompt",
        "",
        "--data.batch_size",
        str(setup.batch_size),
        "--precision",
        setup.precision,
        "--max_steps",
        str(max_steps),
        "--trainer.gradient_clip_val",
        str(CLIP),
        "--trainer.limit_val_batches",
        "0",
        "--trainer.enable_checkpointing",
        "false",
        "--trainer.logger.init_args.save_dir",
        str(workdir),
    ]


# -- the plain loop --------------------------------------------------------------------------


class PlainLoop:
    """The hand-written loop over a TransformerLM of its own: ``step()`` trains one batch."""

    def __init__(self, setup: Setup, data: LMDataModule, device: torch.device, total_steps: int) -> None:
        config = ModelConfig.from_name(
            setup.size, context_length=setup.context, attention=setup.attention, vocab_size=data.vocab_size
        )
        with torch.device(device):
            self.model = TransformerLM(config)
        if setup.compile:
            self.model.compile()  # the whole model, as one compiles a hand-written loop
        self.optimizer = make_adamw(adamw_param_groups(self.model, WEIGHT_DECAY), LR, BETAS)
        self.scheduler = warmup_cosine_schedule(self.optimizer, WARMUP_STEPS, total_steps, MIN_LR_RATIO)
        dtype = PRECISIONS[setup.precision]
        self.autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else nullcontext()
        self.scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
        self.batches: Iterator[torch.Tensor] = iter(data.train_dataloader())
        self.device = device

    def use_attention(self, name: str) -> None:
        """Switch every block to attention ``name`` (a compiled model compiles once more per name)."""
        for module in self.model.modules():
            if isinstance(module, CausalSelfAttention):
                module.attention_name = name

    def step(self) -> None:
        batch = next(self.batches).to(self.device, non_blocking=True)  # (B, T + 1)
        with self.autocast:
            logits = self.model(batch[:, :-1])  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        if self.scaler is None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
            self.optimizer.step()
        else:
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)


# -- the two, interleaved --------------------------------------------------------------------


class _Interleave(Callback):
    """Pauses train.py's fit after step ``warmup`` and after every ``steps`` steps from there, to time the
    segment it just trained and a segment of the plain loop in each attention of ``attentions``.

    Peak memory is each path's own: the allocator's peak during its segment, less what the other path
    holds while paused (train.py's peak before the plain loop exists is read as it is).
    """

    def __init__(
        self,
        make_plain: Callable[[], PlainLoop],
        attentions: list[str],
        warmup: int,
        steps: int,
        rounds: Rounds,
        on_round: Callable[[], None],
    ) -> None:
        self._make_plain, self._attentions = make_plain, attentions
        self._warmup, self._steps = warmup, steps
        self.rounds, self._on_round = rounds, on_round
        self._plain: PlainLoop | None = None
        self._held = {"train_py": 0.0, "plain": 0.0}  # GiB each path holds while the other runs
        self._started = 0.0
        self._warmup_peak = {"train_py": float("nan"), "plain": float("nan")}  # GiB, each path's own

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        reset_peak_memory(trainer.strategy.root_device)

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        step, device = trainer.global_step, trainer.strategy.root_device
        if step < self._warmup or (step - self._warmup) % self._steps:
            return
        synchronize(device)
        if self._plain is None:
            self._warmup_peak["train_py"] = peak_memory_gib(device)
            self._start_plain(device)
        else:
            ms = 1e3 * (time.perf_counter() - self._started) / self._steps
            peak = peak_memory_gib(device) - self._held["plain"]
            self.rounds.train_py.append(Measurement(ms, max(peak, self._warmup_peak["train_py"])))
            for name in self._attentions:
                self.rounds.plain.setdefault(name, []).append(self._plain_segment(name, self._steps, device))
            self._on_round()
        reset_peak_memory(device)
        self._started = time.perf_counter()

    def _start_plain(self, device: torch.device) -> None:
        """Build the plain loop and train it ``warmup`` steps in every attention."""
        self._held["train_py"] = allocated_gib(device)
        reset_peak_memory(device)
        self._plain = self._make_plain()
        warmup_peaks = [self._plain_segment(name, self._warmup, device).peak_gib for name in self._attentions]
        self._warmup_peak["plain"] = max(warmup_peaks)
        self._held["plain"] = allocated_gib(device) - self._held["train_py"]

    def _plain_segment(self, attention: str, steps: int, device: torch.device) -> Measurement:
        self._plain.use_attention(attention)
        reset_peak_memory(device)
        ms = 1e3 * timed(lambda: [self._plain.step() for _ in range(steps)], device) / steps
        peak = peak_memory_gib(device) - self._held["train_py"]
        return Measurement(ms, max(peak, self._warmup_peak["plain"]))


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
    interleave = _Interleave(
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
