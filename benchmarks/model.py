"""End-to-end timing and memory of the TransformerLM: ``python -m benchmarks.model --help``.

Plain PyTorch (no Trainer) so every synchronisation is ours. For each model size × context length
× mode × precision × warm-up count: ``warmup`` untimed steps, then ``steps`` steps each timed
between two device synchronisations, on random tokens. Reports mean ± std per step, tokens/s, MFU
(peaks from ``lm_systems.profiling.hardware``), peak allocated memory and the size of one residual-stream
activation. One model per size and attention serves all of its cases; a configuration that runs out
of GPU memory is a row marked OOM.

    python -m benchmarks.model                                  # small…2.7b × ctx 128..1024
    python -m benchmarks.model --sizes 2.7b --context-lengths 128 256 512 --modes forward train_step
    python -m benchmarks.model --sizes small --context-lengths 512 --warmup-steps 0 1 2 5 --isolate
    python -m benchmarks.model --sizes tiny --device cpu --context-lengths 128 --warmup-steps 1 --steps 2  # quick, CPU
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import statistics
import traceback
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from benchmarks.device import add_device_arg, free_memory, peak_memory_gib, reset_peak_memory, timed
from benchmarks.report import argument_parser, line_plot, write_results
from lm_systems.attention import attention_names, describe_attention
from lm_systems.model.config import MODEL_SIZES, ModelConfig
from lm_systems.model.transformer import TransformerLM
from lm_systems.profiling.hardware import peak_flops

MODES = ("forward", "forward_backward", "train_step")
"""forward: inference (no autograd graph); forward_backward: + loss.backward(); train_step: + AdamW step."""
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""bf16 is mixed precision: fp32 parameters, matmuls under ``torch.autocast(dtype=torch.bfloat16)``."""
# Share of a training step's FLOPs (6N per token) that each mode does: the forward pass is 2N.
FLOP_SHARE = {"forward": 1 / 3, "forward_backward": 1.0, "train_step": 1.0}
CS336_SIZES = ("small", "medium", "large", "xl", "2.7b")
COLUMNS = (
    "size",
    "params_M",
    "context",
    "mode",
    "precision",
    "attention",
    "compile",
    "warmup",
    "status",
    "mean_ms",
    "std_ms",
    "max_ms",
    "tokens_per_s",
    "mfu",
    "peak_mem_GiB",
    "residual_MiB",
)


@dataclass(frozen=True)
class Case:
    """One measured configuration."""

    size: str
    context: int
    mode: str
    precision: str
    attention: str
    compile: bool
    warmup: int
    steps: int
    batch_size: int
    vocab_size: int


def build_model(size: str, context: int, attention: str, vocab_size: int, device: torch.device) -> TransformerLM:
    """The named size with room for ``context`` tokens, initialised directly on ``device``."""
    config = ModelConfig.from_name(size, context_length=context, attention=attention, vocab_size=vocab_size)
    with torch.device(device):
        return TransformerLM(config)


def residual_bytes(case: Case) -> int:
    """Bytes of one (B, T, d_model) residual-stream activation.

    The residual stream is fp32 under bf16 autocast too: autocast casts matmul outputs to bf16, but
    ``x + attn(x)`` with an fp32 ``x`` promotes back to fp32.
    """
    return case.batch_size * case.context * MODEL_SIZES[case.size].d_model * 4


def _run_step(model, optimizer, tokens: torch.Tensor, case: Case) -> None:
    autocast = torch.autocast(tokens.device.type, dtype=torch.bfloat16) if case.precision == "bf16" else nullcontext()
    with torch.no_grad() if case.mode == "forward" else nullcontext(), autocast:
        logits = model(tokens[:, :-1])  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    if case.mode == "forward":
        return
    loss.backward()
    if case.mode == "train_step":
        optimizer.step()
    model.zero_grad(set_to_none=True)


def measure(model, case: Case, device: torch.device) -> dict:
    """Time ``case.steps`` steps of ``model`` after ``case.warmup`` untimed ones; one row of results."""
    generator = torch.Generator(device).manual_seed(0)
    tokens = torch.randint(0, case.vocab_size, (case.batch_size, case.context + 1), device=device, generator=generator)
    # Fused AdamW on the GPU, as LitLM trains: foreach would add a parameter-sized temporary to the peak.
    optimizer = None
    if case.mode == "train_step":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    reset_peak_memory(device)
    for _ in range(case.warmup):
        _run_step(model, optimizer, tokens, case)
    times = [timed(lambda: _run_step(model, optimizer, tokens, case), device) for _ in range(case.steps)]
    mean = statistics.fmean(times)
    tokens_per_step = case.batch_size * case.context
    flops = model.flops_per_token(case.context) * tokens_per_step * FLOP_SHARE[case.mode]
    peak = peak_flops(device, PRECISIONS[case.precision])
    return {
        "status": "ok",
        "mean_ms": mean * 1e3,
        "std_ms": statistics.stdev(times) * 1e3 if len(times) > 1 else 0.0,
        "max_ms": max(times) * 1e3,
        "tokens_per_s": tokens_per_step / mean,
        "mfu": flops / mean / peak if peak else "",
        "peak_mem_GiB": peak_memory_gib(device) if device.type == "cuda" else "",
    }


def _measure_recording_failures(model, case: Case, device: torch.device) -> dict:
    if model is None:
        return {"status": "OOM"}
    try:
        result = measure(model, case, device)
    except torch.cuda.OutOfMemoryError:
        result = {"status": "OOM"}
    except Exception as error:  # one broken configuration (say, a kernel's compile error) must not end the sweep
        traceback.print_exc()
        result = {"status": f"error: {type(error).__name__}"}
    # Outside the except blocks, so the traceback's frames (and the tensors they hold) are gone.
    model.zero_grad(set_to_none=True)
    free_memory(device)
    return result


def run_cases(args: argparse.Namespace) -> list[dict]:
    """Every combination; one model per size and attention, built for the longest context."""
    rows = []
    for size, attention in itertools.product(args.sizes, args.attention):
        free_memory(args.device)
        try:
            model = build_model(size, max(args.context_lengths), attention, args.vocab_size, args.device)
        except torch.cuda.OutOfMemoryError:
            model = None
        if model is not None and args.compile:
            model = torch.compile(model)
        for context, precision, mode, warmup in itertools.product(
            args.context_lengths, args.precisions, args.modes, args.warmup_steps
        ):
            case = Case(
                size,
                context,
                mode,
                precision,
                attention,
                args.compile,
                warmup,
                args.steps,
                args.batch_size,
                args.vocab_size,
            )
            rows.append(
                {
                    **asdict(case),
                    "attention": describe_attention(attention, args.compile),
                    "params_M": model.num_parameters() / 1e6 if model is not None else "",
                    "residual_MiB": residual_bytes(case) / 2**20,
                    **_measure_recording_failures(model, case, args.device),
                }
            )
            timing = f"{rows[-1]['mean_ms']:9.2f} ms" if rows[-1]["status"] == "ok" else rows[-1]["status"]
            print(f"{size} ctx {context} {mode} {precision} {attention} warmup {warmup}: {timing}", flush=True)
        model = None
    return rows


def run_isolated(args: argparse.Namespace) -> list[dict]:
    """Every combination in a fresh process, so that one-time costs (CUDA context, cuBLAS handles, kernel
    loading) fall in its own first steps."""
    swept = ("sizes", "attention", "context_lengths", "precisions", "modes", "warmup_steps")  # run_cases' order
    rows = []
    for values in itertools.product(*(getattr(args, name) for name in swept)):
        one = argparse.Namespace(**{**vars(args), **{name: [value] for name, value in zip(swept, values, strict=True)}})
        with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
            rows += pool.submit(run_cases, one).result()
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argument_parser(__doc__)
    parser.add_argument("--sizes", nargs="+", default=list(CS336_SIZES), choices=list(MODEL_SIZES))
    parser.add_argument("--context-lengths", nargs="+", type=int, default=[128, 256, 512, 1024])
    parser.add_argument("--modes", nargs="+", default=["forward", "forward_backward"], choices=MODES)
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=list(PRECISIONS))
    parser.add_argument(
        "--attention",
        nargs="+",
        default=["auto"],
        choices=attention_names(),
        help="attention implementations, measured in turn on each size",
    )
    parser.add_argument("--warmup-steps", nargs="+", type=int, default=[5], help="untimed steps before timing")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per configuration")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=10_000)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (compiling happens in warm-up)")
    parser.add_argument("--isolate", action="store_true", help="measure each configuration in a fresh process")
    add_device_arg(parser)
    parser.add_argument("--name", default="model_benchmark", help="results file stem under --out-dir")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or min(args.warmup_steps) < 0 or min(args.context_lengths) < 1:
        parser.error("--steps and --batch-size must be >= 1, --warmup-steps >= 0, --context-lengths >= 1")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    rows = run_isolated(args) if args.isolate else run_cases(args)
    notes = (
        f"Batch {args.batch_size}, vocab {args.vocab_size}, random tokens; {args.steps} timed steps after the "
        "stated warm-up, each between two device synchronisations; mean ± std over the timed steps, "
        "max_ms is the slowest (usually the first). forward = inference under no_grad; "
        "forward_backward adds loss.backward(); train_step adds AdamW. bf16 = autocast over fp32 weights. "
        "MFU counts 6N + 12·L·T·d FLOPs per token for a training step (a third for forward) over the "
        "dense peak of lm_systems.profiling.hardware; residual_MiB is one (B, T, d_model) fp32 activation. "
        + ("Each configuration ran in a fresh process. " if args.isolate else "")
        + ("Compiled with torch.compile. " if args.compile else "")
    )
    varying = [
        k for k in ("context", "warmup", "size", "mode", "precision", "attention") if len({r[k] for r in rows}) > 1
    ]
    x = next((k for k in varying if k in ("context", "warmup", "size")), "size")
    plot = line_plot(
        rows,
        x,
        "mean_ms",
        series=[k for k in varying if k in ("size", "attention", "warmup") and k != x],
        panels=[k for k in varying if k in ("mode", "precision")],
        title=f"step time ({args.name})",
        yerr="std_ms",
        log="y",
    )
    write_results(
        args.name,
        rows,
        title=f"TransformerLM step time ({args.name})",
        notes=notes,
        columns=COLUMNS,
        plot=plot,
        out_dir=args.out_dir,
    )
    return rows


if __name__ == "__main__":
    main()
