"""End-to-end timing and memory of the TransformerLM: ``python -m lm_systems.bench.model --help``.

Plain PyTorch (no Trainer) so every synchronisation is ours. For each model size × context length
× mode × precision × warm-up count: ``warmup`` untimed steps, then ``steps`` steps each timed
between two ``torch.cuda.synchronize()`` calls, on random tokens. Reports mean ± std per step,
tokens/s, MFU (peaks from ``lm_systems.hardware``), peak allocated memory and the size of one
residual-stream activation. A configuration that runs out of GPU memory is a row marked OOM.

    python -m lm_systems.bench.model                                  # all sizes × ctx 128..1024
    python -m lm_systems.bench.model --sizes small --warmup-steps 0 1 2 5 --isolate --name model_warmup
    python -m lm_systems.bench.model --sizes 2.7b --context-lengths 128 256 512 --modes forward train_step
    python -m lm_systems.bench.model --sizes tiny --device cpu --steps 2   # a quick CPU check
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from lm_systems.attention import attention_names, resolve_attention_name
from lm_systems.bench.device import free_memory, reset_peak_memory, synchronize
from lm_systems.bench.report import add_out_dir_arg, write_results
from lm_systems.config import MODEL_SIZES, ModelConfig
from lm_systems.hardware import peak_flops
from lm_systems.model import TransformerLM
from lm_systems.nvtx import nvtx_range, set_nvtx_enabled

MODES = ("forward", "forward_backward", "train_step")
"""forward: inference (no autograd graph); forward_backward: + loss.backward(); train_step: + AdamW step."""
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""bf16 is mixed precision: fp32 parameters, matmuls under ``torch.autocast(dtype=torch.bfloat16)``."""
# Share of a training step's FLOPs (6N per token) that each mode does: the forward pass is 2N.
FLOP_SHARE = {"forward": 1 / 3, "forward_backward": 1.0, "train_step": 1.0}
CS336_SIZES = ("small", "medium", "large", "xl", "2.7b")
COLUMNS = (
    "size", "params_M", "context", "mode", "precision", "attention", "compile", "warmup", "status",
    "mean_ms", "std_ms", "max_ms", "tokens_per_s", "mfu", "peak_mem_GiB", "residual_MiB",
)
_GIB = 1024**3


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
    d_model = MODEL_SIZES[case.size].d_model
    return case.batch_size * case.context * d_model * torch.finfo(torch.float32).bits // 8


def _run_step(model, optimizer, tokens: torch.Tensor, case: Case) -> None:
    autocast = (
        torch.autocast(tokens.device.type, dtype=torch.bfloat16) if case.precision == "bf16" else nullcontext()
    )
    grad = torch.no_grad() if case.mode == "forward" else nullcontext()
    with grad, nvtx_range("forward"), autocast:
        logits = model(tokens[:, :-1])  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    if case.mode == "forward":
        return
    with nvtx_range("backward"):
        loss.backward()
    if case.mode == "train_step":
        with nvtx_range("optimizer_step"):
            optimizer.step()
    model.zero_grad(set_to_none=True)


def measure(model, case: Case, device: torch.device, snapshot_dir: Path | None = None) -> dict:
    """Time ``case.steps`` steps of ``model`` after ``case.warmup`` untimed ones; one row of results."""
    generator = torch.Generator(device).manual_seed(0)
    tokens = torch.randint(0, case.vocab_size, (case.batch_size, case.context + 1), device=device, generator=generator)
    # Fused AdamW on the GPU, as LitLM trains: foreach would add a parameter-sized temporary to the peak.
    optimizer = (
        torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda") if case.mode == "train_step" else None
    )
    reset_peak_memory(device)
    try:
        with nvtx_range("warmup"):
            for _ in range(case.warmup):
                _run_step(model, optimizer, tokens, case)
        synchronize(device)
        if snapshot_dir is not None:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        times = []
        with nvtx_range("timed"):
            for i in range(case.steps):
                with nvtx_range(f"step_{i}"):
                    start = time.perf_counter()
                    _run_step(model, optimizer, tokens, case)
                    synchronize(device)
                    times.append(time.perf_counter() - start)
        if snapshot_dir is not None:
            path = snapshot_dir / f"memory_snapshot_{case.size}_ctx{case.context}_{case.mode}_{case.precision}.pickle"
            torch.cuda.memory._dump_snapshot(str(path))
            print(f"wrote {path} (open at https://pytorch.org/memory_viz)")
    finally:
        if snapshot_dir is not None:
            torch.cuda.memory._record_memory_history(enabled=None)
        model.zero_grad(set_to_none=True)
        del optimizer
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
        "peak_mem_GiB": torch.cuda.max_memory_allocated(device) / _GIB if device.type == "cuda" else "",
    }


def _row(case: Case, model: TransformerLM | None, result: dict, device: torch.device) -> dict:
    params = model.num_parameters() / 1e6 if model is not None else ""
    attention = resolve_attention_name(case.attention, device)
    return {
        **asdict(case), "attention": attention, "params_M": params,
        "residual_MiB": residual_bytes(case) / 2**20, **result,
    }


def _measure_recording_failures(model, case: Case, device: torch.device, snapshot_dir: Path | None) -> dict:
    try:
        result = measure(model, case, device, snapshot_dir)
    except torch.cuda.OutOfMemoryError:
        result = {"status": "OOM"}
    except Exception as error:  # one broken configuration (say, a kernel's compile error) must not end the sweep
        traceback.print_exc()
        result = {"status": f"error: {type(error).__name__}"}
    # Outside the except blocks, so the traceback's frames (and the tensors they hold) are gone.
    free_memory(device)
    return result


def run_in_fresh_process(case: Case, device_name: str, nvtx: bool, snapshot_dir: Path | None) -> dict:
    """Build and measure ``case`` in this (new) process: its one-time costs land in its own numbers."""
    device = torch.device(device_name)
    set_nvtx_enabled(nvtx)
    try:
        model = build_model(case.size, case.context, case.attention, case.vocab_size, device)
    except torch.cuda.OutOfMemoryError:
        return _row(case, None, {"status": "OOM"}, device)
    if case.compile:
        model = torch.compile(model)
    return _row(case, model, _measure_recording_failures(model, case, device, snapshot_dir), device)


def run_cases(cases: list[Case], device: torch.device, isolate: bool, nvtx: bool, snapshot_dir: Path | None) -> list[dict]:
    """Measure every case; cases of one size and attention share one model unless ``isolate``."""
    rows = []
    if isolate:
        spawn = multiprocessing.get_context("spawn")
        for case in cases:
            with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
                rows.append(pool.submit(run_in_fresh_process, case, str(device), nvtx, snapshot_dir).result())
            _print_row(rows[-1])
        return rows
    set_nvtx_enabled(nvtx)
    built: tuple[str, str, bool] | None = None
    model = None
    for case in cases:
        key = (case.size, case.attention, case.compile)
        if key != built:
            model, built = None, key
            free_memory(device)
            context = max(c.context for c in cases if (c.size, c.attention, c.compile) == key)
            try:
                model = build_model(case.size, context, case.attention, case.vocab_size, device)
            except torch.cuda.OutOfMemoryError:
                model = None
                free_memory(device)
            if model is not None and case.compile:
                model = torch.compile(model)
        result = _measure_recording_failures(model, case, device, snapshot_dir) if model is not None else {"status": "OOM"}
        rows.append(_row(case, model, result, device))
        _print_row(rows[-1])
    return rows


def _print_row(row: dict) -> None:
    timing = f"{row['mean_ms']:9.2f} ± {row['std_ms']:6.2f} ms" if row["status"] == "ok" else row["status"]
    print(
        f"{row['size']:>6} ctx {row['context']:>5} {row['mode']:>16} {row['precision']} {row['attention']}"
        f" warmup {row['warmup']}: {timing}",
        flush=True,
    )


def plot_step_times(rows: list[dict], path: Path) -> None:
    """Mean ± std step time against the first setting that varies (context, warm-up or size).

    One panel per mode × precision, one line per remaining setting that varies (size, attention, ...).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def varying(keys):
        return [k for k in keys if len({r[k] for r in rows}) > 1]

    measured = [r for r in rows if r["status"] == "ok"]
    x_key = (varying(("context", "warmup", "size")) or ["size"])[0]
    panel_keys = varying(("mode", "precision"))
    series_keys = [k for k in varying(("size", "attention", "compile", "warmup")) if k != x_key]
    panels = list(dict.fromkeys(tuple(r[k] for k in panel_keys) for r in rows))
    columns = min(len(panels), 2)
    fig, axes = plt.subplots(
        (len(panels) + 1) // 2, columns, figsize=(6 * columns, 4 * ((len(panels) + 1) // 2)), squeeze=False
    )
    for ax, panel in zip(axes.flat, panels):
        in_panel = [r for r in measured if tuple(r[k] for k in panel_keys) == panel]
        for label in dict.fromkeys(tuple(r[k] for k in series_keys) for r in in_panel):
            points = [r for r in in_panel if tuple(r[k] for k in series_keys) == label]
            ax.errorbar(
                [str(r[x_key]) for r in points], [r["mean_ms"] for r in points], yerr=[r["std_ms"] for r in points],
                marker="o", capsize=3, label=" ".join(map(str, label)) or None,
            )
        ax.set_title(" ".join(map(str, panel)) or "step time")
        ax.set_yscale("log")
        ax.set_xlabel(x_key)
        ax.set_ylabel("ms per step (mean ± std)")
        ax.grid(True, which="both", alpha=0.3)
        if series_keys:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m lm_systems.bench.model", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", nargs="+", default=list(CS336_SIZES), choices=list(MODEL_SIZES))
    parser.add_argument("--context-lengths", nargs="+", type=int, default=[128, 256, 512, 1024])
    parser.add_argument("--modes", nargs="+", default=["forward", "forward_backward"], choices=MODES)
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=list(PRECISIONS))
    parser.add_argument("--attention", nargs="+", default=["auto"], choices=attention_names(),
                        help="attention implementations, measured in turn on each size")
    parser.add_argument("--warmup-steps", nargs="+", type=int, default=[5], help="untimed steps before timing")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per configuration")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=10_000)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (compiling happens in warm-up)")
    parser.add_argument("--isolate", action="store_true",
                        help="measure each configuration in a fresh process (CUDA context, cuBLAS handles and "
                             "kernel loading then fall in the first steps of every configuration)")
    parser.add_argument("--nvtx", action="store_true", help="emit NVTX ranges (for nsys profile -t cuda,nvtx)")
    parser.add_argument("--memory-snapshot", type=Path, default=None, metavar="DIR",
                        help="record allocations over the timed steps; one pickle per configuration in DIR")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--name", default="model_benchmark", help="results file stem under --out-dir")
    add_out_dir_arg(parser)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or min(args.warmup_steps) < 0 or min(args.context_lengths) < 1:
        parser.error("--steps and --batch-size must be >= 1, --warmup-steps >= 0, --context-lengths >= 1")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but no CUDA device is visible: pass --device cpu")
    if args.memory_snapshot is not None and torch.device(args.device).type != "cuda":
        parser.error("--memory-snapshot records the CUDA allocator: it needs --device cuda")
    return args


def cases_from_args(args: argparse.Namespace) -> list[Case]:
    """Every combination; sizes outermost so one model serves all of its cases."""
    return [
        Case(size, context, mode, precision, attention, args.compile, warmup, args.steps, args.batch_size, args.vocab_size)
        for size in args.sizes
        for attention in args.attention
        for context in args.context_lengths
        for precision in args.precisions
        for mode in args.modes
        for warmup in args.warmup_steps
    ]


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.memory_snapshot is not None:
        args.memory_snapshot.mkdir(parents=True, exist_ok=True)
    cases = cases_from_args(args)
    rows = run_cases(cases, device, args.isolate, args.nvtx, args.memory_snapshot)
    notes = (
        f"Batch {args.batch_size}, vocab {args.vocab_size}, random tokens; {args.steps} timed steps after the "
        "stated warm-up, each between two device synchronisations; mean ± std over the timed steps, "
        "max_ms is the slowest (usually the first). forward = inference under no_grad; "
        "forward_backward adds loss.backward(); train_step adds AdamW. bf16 = autocast over fp32 weights. "
        "MFU counts 6N + 12·L·T·d FLOPs per token for a training step (a third for forward) over the "
        "dense peak of lm_systems.hardware; residual_MiB is one (B, T, d_model) fp32 activation. "
        + ("Each configuration ran in a fresh process. " if args.isolate else "")
        + ("Compiled with torch.compile. " if args.compile else "")
    )
    write_results(
        args.name, rows, title=f"TransformerLM step time ({args.name})", notes=notes,
        columns=COLUMNS, plot=lambda path: plot_step_times(rows, path), out_dir=args.out_dir,
    )
    return rows


if __name__ == "__main__":
    main()
