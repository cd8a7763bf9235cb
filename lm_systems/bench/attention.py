"""Attention benchmarks: ``python -m lm_systems.bench.attention --mode {pytorch,flash,headline,all}``.

- ``pytorch``: the PyTorch (naive) attention sweep — batch 8, one head, d × N grid, fp32, causal;
  100 timed forwards and 100 timed backwards each, memory in use before backward, OOM as OOM, and
  the memory accounting of the smallest configuration that runs out of memory.
- ``flash``: batch 1, causal, N from 128 to 65536, d 16…128, bf16 and fp32; forward, backward and
  forward+backward ms and TFLOP/s for naive, naive under torch.compile, SDPA's flash and cuDNN
  backends, flash_torch and flash_triton, square and rectangular (N_q = N_k / 4), in one run.
- ``headline``: B1 H16 N16384 d64 bf16 causal forward+backward of
  ``torch.compile(FlashAttention2Triton.apply)`` beside SDPA's flash and cuDNN backends, measured
  interleaved over several rounds and reported as ratios (plus d128 and naive attention).

Times are medians of ``triton.testing.do_bench`` (CUDA events) unless the mode says otherwise.
FLOPs count only the (query, key) pairs causal attention keeps: forward 4·d per pair (QKᵀ and PV),
backward 2.5× the forward (five products against two), the FlashAttention-2 paper's convention.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

import torch

from lm_systems.bench.report import add_out_dir_arg, write_results

AttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def visible_pairs(n_q: int, n_k: int, is_causal: bool) -> int:
    """(query, key) pairs attention computes; causal queries end-aligned (query i sees j <= i + n_k - n_q)."""
    if not is_causal:
        return n_q * n_k
    shift = n_k - n_q
    return sum(min(n_k, max(0, i + shift + 1)) for i in range(n_q))


def attention_flops(batch_heads: int, n_q: int, n_k: int, d: int, is_causal: bool) -> dict[str, float]:
    fwd = 4.0 * d * visible_pairs(n_q, n_k, is_causal) * batch_heads
    return {"fwd": fwd, "bwd": 2.5 * fwd, "fwd+bwd": 3.5 * fwd}


def _sdpa_backend(backend_name: str) -> AttnFn:
    """SDPA restricted to one backend; rectangular causal uses the end-aligned (lower-right) bias."""
    import torch.nn.attention.bias as attn_bias
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend_name]

    def attend(q, k, v, is_causal):
        with sdpa_kernel(backend):
            if is_causal and q.shape[-2] != k.shape[-2]:
                bias = attn_bias.causal_lower_right(q.shape[-2], k.shape[-2])
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal)

    return attend


def implementations(names: list[str]) -> dict[str, AttnFn]:
    """Name → attention function for the benchmark; each is built only when asked for."""
    from lm_systems.attention import get_attention
    from lm_systems.attention.flash_triton import FlashAttention2Triton

    # Timing backward alone replays one compiled backward with retain_graph=True, which AOTAutograd
    # refuses when it donated the saved buffers to the backward graph (seen at d = 128).
    import torch._functorch.config

    torch._functorch.config.donated_buffer = False
    builders = {
        "naive": lambda: get_attention("naive"),
        "naive_compiled": lambda: torch.compile(get_attention("naive"), dynamic=True),
        "sdpa_flash": lambda: _sdpa_backend("flash"),
        "sdpa_cudnn": lambda: _sdpa_backend("cudnn"),
        "flash_torch": lambda: get_attention("flash_torch"),
        "flash_triton": lambda: get_attention("flash_triton"),
        "flash_triton_compiled": lambda: torch.compile(FlashAttention2Triton.apply),
    }
    unknown = set(names) - set(builders)
    if unknown:
        raise SystemExit(f"unknown --impls {sorted(unknown)}; choose from {', '.join(builders)}")
    return {name: builders[name]() for name in names}


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


def time_attention(fn: AttnFn, q, k, v, is_causal: bool, rep_ms: int) -> dict[str, float | str]:
    """Median ms of forward, backward alone and forward+backward; 'OOM' or 'unsupported' where one fails."""
    from triton.testing import do_bench

    grad_out = torch.randn_like(q)

    def bench(run, **kwargs) -> float:
        return do_bench(run, warmup=max(5, rep_ms // 4), rep=rep_ms, return_mode="median", **kwargs)

    def backward_alone() -> float:
        out = fn(q, k, v, is_causal)  # one graph, its backward replayed (retain_graph) under the timer
        return bench(lambda: out.backward(grad_out, retain_graph=True), grad_to_none=[q, k, v])

    parts = {
        "fwd": lambda: bench(lambda: fn(q, k, v, is_causal)),
        "bwd": backward_alone,
        "fwd+bwd": lambda: bench(lambda: fn(q, k, v, is_causal).backward(grad_out), grad_to_none=[q, k, v]),
    }
    times: dict[str, float | str] = {}
    for part, measure in parts.items():
        try:
            times[part] = measure()
        except Exception as error:  # noqa: BLE001 - a failure of one implementation is a table entry
            times[part] = "OOM" if _is_oom(error) else "unsupported"
            if times[part] == "unsupported":
                print(f"  {getattr(fn, '__name__', fn)} {part}: {type(error).__name__}: {str(error).splitlines()[0][:160]}")
        finally:
            q.grad = k.grad = v.grad = None
            torch.cuda.empty_cache()
    return times


def _qkv(batch: int, heads: int, n_q: int, n_k: int, d: int, dtype: torch.dtype):
    make = lambda n: torch.randn(batch, heads, n, d, device="cuda", dtype=dtype, requires_grad=True)  # noqa: E731
    return make(n_q), make(n_k), make(n_k)


# --------------------------------------------------------------------------- mode 1: PyTorch sweep


def pytorch_sweep(args) -> None:
    """Naive attention, batch 8, one head, fp32, causal: per-call timings with events and memory before backward."""
    attend = implementations(["naive"])["naive"]
    rows, first_oom = [], None
    for d in args.pytorch_head_dims:
        for n in args.pytorch_seq_lens:
            row = {"d": d, "N": n}
            try:
                q, k, v = (torch.randn(8, n, d, device="cuda", requires_grad=True) for _ in range(3))
                row.update(_per_call_timings(attend, q, k, v, args.repeats))
            except Exception as error:  # noqa: BLE001
                if not _is_oom(error):
                    raise
                row.update({"fwd_ms": "OOM", "bwd_ms": "OOM", "mem_before_bwd_MiB": "OOM"})
                first_oom = first_oom or (d, n)
            finally:
                q = k = v = None
                torch.cuda.empty_cache()
            rows.append(row)
            print(row, flush=True)
    notes = _memory_accounting(rows, first_oom)
    write_results(
        "attention_pytorch_sweep", rows, "Naive PyTorch attention: batch 8, one head, fp32, causal",
        notes=notes + f"\n\nEach time is the mean of {args.repeats} calls, each bracketed by CUDA events.",
        columns=["d", "N", "fwd_ms", "bwd_ms", "mem_before_bwd_MiB"], out_dir=args.out_dir,
        plot=lambda path: _plot_pytorch(rows, path),
    )


def _per_call_timings(attend: AttnFn, q, k, v, repeats: int) -> dict[str, float]:
    grad_out = torch.randn_like(q)
    for _ in range(3):  # warm-up: allocator, cuBLAS handles
        attend(q, k, v, True).backward(grad_out)
    q.grad = k.grad = v.grad = None
    fwd_ms, bwd_ms = [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(repeats):
        start.record()
        out = attend(q, k, v, True)
        end.record()
        torch.cuda.synchronize()
        fwd_ms.append(start.elapsed_time(end))
    mem_before_bwd = torch.cuda.memory_allocated() / 2**20  # one live graph: `out` of the last forward
    for _ in range(repeats):
        out = attend(q, k, v, True)
        torch.cuda.synchronize()
        start.record()
        out.backward(grad_out)
        end.record()
        torch.cuda.synchronize()
        bwd_ms.append(start.elapsed_time(end))
    return {"fwd_ms": sum(fwd_ms) / repeats, "bwd_ms": sum(bwd_ms) / repeats, "mem_before_bwd_MiB": mem_before_bwd}


def _memory_accounting(rows: list[dict], first_oom: tuple[int, int] | None) -> str:
    """Bytes per score element kept for backward, measured on the largest run, applied to the first OOM."""
    ran = [r for r in rows if r["fwd_ms"] != "OOM"]
    largest = max(ran, key=lambda r: (r["N"], r["d"]))
    b, n, d = 8, largest["N"], largest["d"]
    io_mib = 5 * b * n * d * 4 / 2**20  # q, k, v, dO and the output, fp32
    per_elem = (largest["mem_before_bwd_MiB"] - io_mib) * 2**20 / (b * n * n)
    text = (
        f"Memory accounting: the largest run (d={d}, N={n}) holds {largest['mem_before_bwd_MiB']:.0f} MiB before "
        f"backward; beyond q, k, v, dO and O that is {per_elem:.2f} bytes per element of the B·N² score matrix: "
        "softmax's fp32 output P (4 B), which the backward of softmax and of P·V both need, and the boolean "
        "causal mask (N² bytes shared by the batch). Backward then allocates dP and dS, two more fp32 B·N² "
        "buffers (8 B per element), while P is still alive."
    )
    if first_oom is None:
        return text + " No configuration of this sweep ran out of memory on this GPU."
    d_oom, n_oom = first_oom
    need = (per_elem + 8) * b * n_oom * n_oom / 2**30
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    return text + (
        f" Smallest configuration out of memory: d={d_oom}, N={n_oom}: ({per_elem:.2f} + 8) B × 8·{n_oom}² "
        f"≈ {need:.0f} GiB at the start of backward, against {total:.0f} GiB on the GPU."
    )


def _plot_pytorch(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for d in sorted({r["d"] for r in rows}):
        pts = [(r["N"], r["fwd_ms"] + r["bwd_ms"]) for r in rows if r["d"] == d and r["fwd_ms"] != "OOM"]
        if pts:
            ax.loglog(*zip(*pts), marker="o", label=f"d={d}")
    ax.set(xlabel="sequence length N", ylabel="forward + backward (ms)", title="naive attention, B8 fp32")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- mode 2: flash sweep

FLASH_IMPLS = ["naive", "naive_compiled", "sdpa_flash", "sdpa_cudnn", "flash_torch", "flash_triton"]


def flash_sweep(args) -> None:
    """Batch 1, one head, causal: every implementation at every (N, d, dtype, shape), in one run."""
    impls = implementations(args.flash_impls)
    rows: list[dict] = []
    try:
        for dtype_name in args.flash_dtypes:
            for d in args.flash_head_dims:
                for n in args.flash_seq_lens:
                    for shape in ("square", "rect"):
                        n_q = n if shape == "square" else n // 4  # rectangular: a chunk of queries over a longer cache
                        flops = attention_flops(args.flash_heads, n_q, n, d, True)
                        q, k, v = _qkv(1, args.flash_heads, n_q, n, d, DTYPES[dtype_name])
                        for name, fn in impls.items():
                            if name == "flash_torch" and n_q * n > args.flash_torch_max_pairs:
                                times = dict.fromkeys(flops, "skipped")
                            else:
                                times = time_attention(fn, q, k, v, True, args.rep_ms)
                            row = {"impl": name, "dtype": dtype_name, "d": d, "N_q": n_q, "N_k": n}
                            for part in ("fwd", "bwd", "fwd+bwd"):
                                t = times[part]
                                row[f"{part}_ms"] = t
                                row[f"{part}_TFLOPs"] = flops[part] / t / 1e9 if isinstance(t, float) else ""
                            rows.append(row)
                        q = k = v = None
                        print(f"{dtype_name} d={d} N_q={n_q} N_k={n}: " + ", ".join(
                            f"{r['impl']} {_fmt(r['fwd+bwd_ms'])}" for r in rows[-len(impls):]), flush=True)
    finally:  # a time limit (SIGINT) or a crash still leaves the points measured so far
        _write_flash(rows, args, complete=len(rows) == len(impls) * 2 * len(args.flash_dtypes)
                     * len(args.flash_head_dims) * len(args.flash_seq_lens))


def _write_flash(rows: list[dict], args, complete: bool) -> None:
    if not rows:
        return
    columns = ["impl", "dtype", "d", "N_q", "N_k", "fwd_ms", "bwd_ms", "fwd+bwd_ms",
               "fwd_TFLOPs", "bwd_TFLOPs", "fwd+bwd_TFLOPs"]
    write_results(
        "attention_flash_sweep", rows, f"Attention implementations: batch 1, {args.flash_heads} head(s), causal",
        notes=(
            ("" if complete else "**Partial run: stopped before the grid was done.** ")
            + "Median of triton.testing.do_bench "
            f"(rep {args.rep_ms} ms). 'rect' rows: N_q = N_k / 4, queries end-aligned to the keys. "
            "TFLOP/s count only the (query, key) pairs causal attention keeps (forward 4·d per pair, "
            "backward 2.5×). OOM: out of memory; unsupported: the backend refused the dtype or shape; "
            f"skipped: flash_torch beyond {args.flash_torch_max_pairs:.2g} score elements (minutes per point)."
        ),
        columns=columns, out_dir=args.out_dir, plot=lambda path: _plot_flash(rows, path),
    )


def _fmt(value) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _plot_flash(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["dtype"], r["d"]) for r in rows})
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    colors = dict(zip(impls, plt.rcParams["axes.prop_cycle"].by_key()["color"]))  # one colour per impl in every panel
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6), squeeze=False)
    for ax, (dtype_name, d) in zip(axes[0], panels):
        for impl in impls:
            pts = [(r["N_k"], r["fwd+bwd_TFLOPs"]) for r in rows if r["impl"] == impl and r["dtype"] == dtype_name
                   and r["d"] == d and r["N_q"] == r["N_k"] and r["fwd+bwd_TFLOPs"] != ""]
            if pts:
                ax.semilogx(*zip(*pts), marker=".", color=colors[impl], label=impl)
        ax.set(title=f"{dtype_name} d={d} (square)", xlabel="N", ylabel="fwd+bwd TFLOP/s")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- mode 3: headline

HEADLINE_IMPLS = ["flash_triton_compiled", "flash_triton", "sdpa_flash", "sdpa_cudnn"]


def headline(args) -> None:
    """B1 H16 N16384 bf16 causal, d 64 (the target) and 128, interleaved rounds; naive for the OOM check."""
    impls = implementations(HEADLINE_IMPLS)
    rows = []
    for d in (64, 128):
        q, k, v = _qkv(1, 16, args.headline_n, args.headline_n, d, torch.bfloat16)
        flops = attention_flops(16, args.headline_n, args.headline_n, d, True)
        samples = {name: {"fwd": [], "bwd": [], "fwd+bwd": []} for name in impls}
        for _ in range(args.rounds):  # interleaved: every implementation once per round, so drift hits all alike
            for name, fn in impls.items():
                for part, t in time_attention(fn, q, k, v, True, args.rep_ms).items():
                    samples[name][part].append(t)
        med = {name: {part: _median(ts) for part, ts in parts.items()} for name, parts in samples.items()}
        for name in impls:
            row = {"impl": name, "d": d}
            for part in ("fwd", "bwd", "fwd+bwd"):
                t = med[name][part]
                row[f"{part}_ms"] = t
                row[f"{part}_TFLOPs"] = flops[part] / t / 1e9 if isinstance(t, float) else ""
                for base in ("sdpa_flash", "sdpa_cudnn"):
                    ref = med[base][part]
                    ok = isinstance(t, float) and isinstance(ref, float)
                    row[f"{part}_vs_{base}"] = ref / t if ok else ""
            rows.append(row)
        q = k = v = None
    from lm_systems.attention.flash_triton_autotune import tuned_configs

    chosen = "; ".join(f"{kind} {key[:4]}: {config}" for kind, configs in tuned_configs().items()
                       for key, config in configs.items())
    rows += _naive_rows(args)
    ratio_cols = [f"{p}_vs_{b}" for p in ("fwd+bwd", "bwd") for b in ("sdpa_flash", "sdpa_cudnn")]
    write_results(
        "attention_headline", rows,
        f"Headline: B1 H16 N{args.headline_n} bf16 causal, forward + backward",
        notes=(
            f"Median over {args.rounds} interleaved rounds of the median of triton.testing.do_bench "
            f"(rep {args.rep_ms} ms). flash_triton_compiled is torch.compile(FlashAttention2Triton.apply), "
            "flash_triton the same Function called eagerly. "
            "Ratios are speed-ups: baseline time / this time (above 1 means faster than the baseline). "
            "naive rows: the model's PyTorch attention at the same shape (and at batch 2, beside flash_triton "
            "in fp32), to show where it runs out of memory. "
            f"Tiles the autotuner chose (N_q, N_k, d, causal): {chosen}."
        ),
        columns=["impl", "d", "fwd_ms", "bwd_ms", "fwd+bwd_ms", "fwd+bwd_TFLOPs", *ratio_cols],
        out_dir=args.out_dir,
    )


def _median(values: list) -> float | str:
    numbers = sorted(v for v in values if isinstance(v, float))
    return numbers[len(numbers) // 2] if numbers else values[0]


def _naive_rows(args) -> list[dict]:
    """Naive attention at the headline shape (bf16, fp32), and at batch 2 in fp32 beside flash_triton: on an
    80 GB card batch 1 still fits (about 50 GB of scores and softmax), batch 2 does not."""
    rows = []
    impls = implementations(["naive", "flash_triton"])
    for name, dtype_name, batch in (("naive", "bf16", 1), ("naive", "fp32", 1), ("naive", "fp32", 2),
                                    ("flash_triton", "fp32", 2)):
        q, k, v = _qkv(batch, 16, args.headline_n, args.headline_n, 64, DTYPES[dtype_name])
        times = time_attention(impls[name], q, k, v, True, args.rep_ms)
        label = f"{name} ({dtype_name}" + (f", B{batch})" if batch > 1 else ")")
        rows.append({"impl": label, "d": 64, **{f"{p}_ms": t for p, t in times.items()}})
        q = k = v = None
    return rows


# --------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["pytorch", "flash", "headline", "all"], default="headline")
    parser.add_argument("--pytorch-seq-lens", type=int, nargs="+", default=[256, 1024, 4096, 8192, 16384])
    parser.add_argument("--pytorch-head-dims", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--flash-seq-lens", type=int, nargs="+", default=[2**p for p in range(7, 17)])
    parser.add_argument("--flash-head-dims", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--flash-dtypes", nargs="+", choices=list(DTYPES), default=["bf16", "fp32"])
    parser.add_argument("--flash-impls", nargs="+", default=FLASH_IMPLS, help="implementations in the flash sweep")
    parser.add_argument("--flash-heads", type=int, default=1, help="heads in the flash sweep (batch is 1)")
    parser.add_argument("--repeats", type=int, default=100, help="timed calls per pass in the PyTorch sweep")
    parser.add_argument("--rep-ms", type=int, default=100, help="do_bench measuring time per point (ms)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the headline")
    parser.add_argument("--headline-n", type=int, default=16384, help="sequence length of the headline")
    parser.add_argument("--flash-torch-max-pairs", type=float, default=2**28,
                        help="skip flash_torch above this many score elements N_q·N_k")
    add_out_dir_arg(parser)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("lm_systems.bench.attention needs a CUDA GPU (the SDPA backends and Triton kernels time on one)")
    modes = ["headline", "pytorch", "flash"] if args.mode == "all" else [args.mode]
    for mode in modes:
        {"pytorch": pytorch_sweep, "flash": flash_sweep, "headline": headline}[mode](args)


if __name__ == "__main__":
    main()
