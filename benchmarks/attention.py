"""Causal attention benchmarks (CUDA): ``python -m benchmarks.attention --mode {headline,flash}``.

- ``headline``: B1 H16 N16384 bf16, d 64 and 128, and the 8B model's B1 H32 N32768 d 128:
  ``torch.compile(FlashAttention2Triton.apply)``, flash_triton eager and flash_triton's portable kernels alone
  (eager, ``LM_SYSTEMS_FLASH_HOPPER=0``: on Hopper flash_triton runs its Gluon backward, and at d 128 forward) beside
  SDPA's flash and cuDNN backends, over interleaved rounds, as ratios; and naive attention at the first shape (and at
  batch 2, fp32, beside flash_triton in fp32) where it runs out of memory.
- ``flash``: batch 1, one head, N 128…65536, d 16…128, bf16 and fp32: every implementation's forward,
  backward and forward+backward ms and TFLOP/s, square and rectangular (N_q = N_k / 4).

Times are medians of ``triton.testing.do_bench``. FLOPs count only the (query, key) pairs causal attention
keeps: forward 4·d per pair (QKᵀ and PV), backward 2.5× the forward (five products against two), the
FlashAttention-2 paper's convention.
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Callable
from unittest import mock

import torch

from benchmarks.report import argument_parser, format_value, line_plot, write_results

AttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PARTS = ("fwd", "bwd", "fwd+bwd")
HEADLINE_N = 16384
HEADLINE_SHAPES = ((16, HEADLINE_N, 64), (16, HEADLINE_N, 128), (32, 2 * HEADLINE_N, 128))  # heads, N, d (batch 1)
# Environment a headline implementation is timed under (its forward and its backward)
HEADLINE_ENV = {"flash_triton_portable": {"LM_SYSTEMS_FLASH_HOPPER": "0"}}
FLASH_IMPLS = ["naive", "naive_compiled", "sdpa_flash", "sdpa_cudnn", "flash_torch", "flash_triton"]
FLASH_TORCH_MAX_PAIRS = 2**28  # flash_torch beyond this many score elements takes minutes per point


def attention_flops(batch_heads: int, n_q: int, n_k: int, d: int) -> dict[str, float]:
    """FLOPs of causal attention, queries end-aligned to the keys (query i sees key j <= i + n_k - n_q)."""
    pairs = sum(min(n_k, max(0, i + n_k - n_q + 1)) for i in range(n_q))
    fwd = 4.0 * d * pairs * batch_heads
    return {"fwd": fwd, "bwd": 2.5 * fwd, "fwd+bwd": 3.5 * fwd}


def implementations(names: list[str]) -> dict[str, AttnFn]:
    """Name → attention function: the registry's, SDPA on one backend, or a compiled one."""
    import torch._functorch.config
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    from lm_systems.attention import get_attention
    from lm_systems.attention.flash_triton import FlashAttention2Triton

    def sdpa(backend: SDPBackend) -> AttnFn:
        def attend(q, k, v, is_causal):  # causal, end-aligned where N_q < N_k
            with sdpa_kernel(backend):
                mask = causal_lower_right(q.shape[-2], k.shape[-2])
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

        return attend

    # Timing backward alone replays one compiled backward with retain_graph=True, which AOTAutograd
    # refuses when it donated the saved buffers to the backward graph (seen at d = 128).
    torch._functorch.config.donated_buffer = False
    builders = {
        "naive_compiled": lambda: torch.compile(get_attention("naive"), dynamic=True),
        "sdpa_flash": lambda: sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa_cudnn": lambda: sdpa(SDPBackend.CUDNN_ATTENTION),
        "flash_triton_compiled": lambda: torch.compile(FlashAttention2Triton.apply),
        "flash_triton_portable": lambda: FlashAttention2Triton.apply,  # timed under HEADLINE_ENV
    }
    return {name: builders[name]() if name in builders else get_attention(name) for name in names}


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


def time_attention(fn: AttnFn, q, k, v, rep_ms: int) -> dict[str, float | str]:
    """Median ms of causal forward, backward alone and forward+backward; 'OOM' or 'unsupported' where one fails."""
    from triton.testing import do_bench

    grad_out = torch.randn_like(q)

    def backward_alone() -> Callable[[], None]:
        out = fn(q, k, v, True)  # one graph, its backward replayed (retain_graph) under the timer
        return lambda: out.backward(grad_out, retain_graph=True)

    calls = {
        "fwd": lambda: lambda: fn(q, k, v, True),
        "bwd": backward_alone,
        "fwd+bwd": lambda: lambda: fn(q, k, v, True).backward(grad_out),
    }
    times: dict[str, float | str] = {}
    for part, make_call in calls.items():
        try:
            times[part] = do_bench(
                make_call(), warmup=max(5, rep_ms // 4), rep=rep_ms, return_mode="median", grad_to_none=[q, k, v]
            )
        except Exception as error:  # noqa: BLE001 - a failure of one implementation is a table entry
            times[part] = "OOM" if _is_oom(error) else "unsupported"
            if times[part] == "unsupported":
                print(f"  {part}: {type(error).__name__}: {str(error).splitlines()[0][:160]}")
        finally:
            q.grad = k.grad = v.grad = None
            torch.cuda.empty_cache()
    return times


def _qkv(batch: int, heads: int, n_q: int, n_k: int, d: int, dtype: torch.dtype):
    return tuple(
        torch.randn(batch, heads, n, d, device="cuda", dtype=dtype, requires_grad=True) for n in (n_q, n_k, n_k)
    )


def _with_tflops(row: dict, times: dict, flops: dict) -> dict:
    """``row`` with each part's ms and TFLOP/s (empty where the time is not a number)."""
    for part in PARTS:
        row[f"{part}_ms"] = times[part]
        row[f"{part}_TFLOPs"] = flops[part] / times[part] / 1e9 if isinstance(times[part], float) else ""
    return row


def headline(args: argparse.Namespace) -> None:
    from lm_systems.attention.tuning import tuned_configs

    impls = implementations(
        ["flash_triton_compiled", "flash_triton", "flash_triton_portable", "sdpa_flash", "sdpa_cudnn"]
    )
    rows = []
    for heads, n, d in HEADLINE_SHAPES:
        q, k, v = _qkv(1, heads, n, n, d, torch.bfloat16)
        samples: dict[str, dict[str, list]] = {name: {part: [] for part in PARTS} for name in impls}
        for _ in range(args.rounds):  # interleaved: every implementation once per round, so drift hits all alike
            for name, fn in impls.items():
                with headline_environment(name):
                    for part, t in time_attention(fn, q, k, v, args.rep_ms).items():
                        samples[name][part].append(t)
        median = {name: {part: _median(ts) for part, ts in parts.items()} for name, parts in samples.items()}
        for name in impls:
            flops = attention_flops(heads, n, n, d)
            row = _with_tflops({"impl": name, "H": heads, "N": n, "d": d}, median[name], flops)
            for part in PARTS:
                for base in ("sdpa_flash", "sdpa_cudnn"):
                    ref, t = median[base][part], median[name][part]
                    row[f"{part}_vs_{base}"] = ref / t if isinstance(t, float) and isinstance(ref, float) else ""
            rows.append(row)
        q = k = v = None
    # On an 80 GB card naive attention fits at batch 1 (about 50 GB of scores and softmax), not at batch 2.
    impls = implementations(["naive", "flash_triton"])
    for name, dtype, batch in (
        ("naive", "bf16", 1),
        ("naive", "fp32", 1),
        ("naive", "fp32", 2),
        ("flash_triton", "fp32", 2),
    ):
        times = time_attention(impls[name], *_qkv(batch, 16, HEADLINE_N, HEADLINE_N, 64, DTYPES[dtype]), args.rep_ms)
        label = f"{name} ({dtype}" + (f", B{batch})" if batch > 1 else ")")
        rows.append({"impl": label, "H": 16, "N": HEADLINE_N, "d": 64, **{f"{p}_ms": t for p, t in times.items()}})
    tiles = "; ".join(
        f"{kind} {key[:4]}: {config}" for kind, configs in tuned_configs().items() for key, config in configs.items()
    )
    write_results(
        "attention_headline",
        rows,
        f"Headline: B1 H16 N{HEADLINE_N} and B1 H32 N{2 * HEADLINE_N} bf16 causal, forward + backward",
        notes=f"Median over {args.rounds} interleaved rounds of the median of triton.testing.do_bench "
        f"(rep {args.rep_ms} ms). flash_triton_compiled is torch.compile(FlashAttention2Triton.apply), "
        "flash_triton the same Function called eagerly, flash_triton_portable eagerly with LM_SYSTEMS_FLASH_HOPPER=0 "
        "(its portable kernels; on Hopper flash_triton runs its Gluon backward, and at d 128 its Gluon forward). "
        "Ratios are speed-ups: baseline time / this time "
        "(above 1 means faster than the baseline). naive rows: the model's PyTorch attention at the same shape "
        "(and at batch 2, beside flash_triton in fp32), to show where it runs out of memory. "
        f"Tiles the autotuner chose (N_q, N_k, d, causal): {tiles}.",
        columns=[
            "impl",
            "H",
            "N",
            "d",
            "fwd_ms",
            "bwd_ms",
            "fwd+bwd_ms",
            "fwd+bwd_TFLOPs",
            *(f"{p}_vs_{b}" for p in ("fwd+bwd", "bwd") for b in ("sdpa_flash", "sdpa_cudnn")),
        ],
        out_dir=args.out_dir,
    )


def headline_environment(name: str):
    """The environment the headline times implementation ``name`` under (``HEADLINE_ENV``), restored after."""
    return mock.patch.dict(os.environ, HEADLINE_ENV.get(name, {}))


def _median(values: list) -> float | str:
    """The median of the numbers among ``values``; the first failure ('OOM', ...) when there are none."""
    numbers = [v for v in values if isinstance(v, float)]
    return statistics.median_high(numbers) if numbers else values[0]


def flash_sweep(args: argparse.Namespace) -> None:
    impls = implementations(FLASH_IMPLS)
    rows: list[dict] = []
    try:
        for dtype in args.flash_dtypes:
            for d in args.flash_head_dims:
                for n, n_q in ((n_k, n_q) for n_k in args.flash_seq_lens for n_q in (n_k, n_k // 4)):
                    q, k, v = _qkv(1, 1, n_q, n, d, DTYPES[dtype])
                    for name, fn in impls.items():
                        skip = name == "flash_torch" and n_q * n > FLASH_TORCH_MAX_PAIRS
                        times = dict.fromkeys(PARTS, "skipped") if skip else time_attention(fn, q, k, v, args.rep_ms)
                        row = {"impl": name, "dtype": dtype, "d": d, "N_q": n_q, "N_k": n}
                        rows.append(_with_tflops(row, times, attention_flops(1, n_q, n, d)))
                    q = k = v = None
                    print(
                        f"{dtype} d={d} N_q={n_q} N_k={n}: "
                        + ", ".join(f"{r['impl']} {format_value(r['fwd+bwd_ms'])}" for r in rows[-len(impls) :]),
                        flush=True,
                    )
    finally:  # a time limit (SIGINT) or a crash still leaves the points measured so far
        if rows:
            _write_flash(rows, args)


def _write_flash(rows: list[dict], args: argparse.Namespace) -> None:
    points = len(FLASH_IMPLS) * 2 * len(args.flash_dtypes) * len(args.flash_head_dims) * len(args.flash_seq_lens)
    write_results(
        "attention_flash_sweep",
        rows,
        "Attention implementations: batch 1, 1 head(s), causal",
        notes=("" if len(rows) == points else "**Partial run: stopped before the grid was done.** ")
        + f"Median of triton.testing.do_bench (rep {args.rep_ms} ms). 'rect' rows: N_q = N_k / 4, queries "
        "end-aligned to the keys. TFLOP/s count only the (query, key) pairs causal attention keeps "
        "(forward 4·d per pair, backward 2.5×). OOM: out of memory; unsupported: the backend refused the "
        f"dtype or shape; skipped: flash_torch beyond {FLASH_TORCH_MAX_PAIRS:.2g} score elements.",
        columns=["impl", "dtype", "d", "N_q", "N_k", *(f"{p}_ms" for p in PARTS), *(f"{p}_TFLOPs" for p in PARTS)],
        plot=line_plot(
            [r for r in rows if r["N_q"] == r["N_k"]],
            "N_k",
            "fwd+bwd_TFLOPs",
            series=["impl"],
            panels=["dtype", "d"],
            title="square, batch 1, one head",
            log="x",
        ),
        out_dir=args.out_dir,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--mode", choices=["headline", "flash"], default="headline")
    parser.add_argument("--rounds", type=int, default=5, help="headline: interleaved rounds")
    parser.add_argument("--rep-ms", type=int, default=100, help="headline, flash: do_bench measuring time per point")
    parser.add_argument("--flash-seq-lens", type=int, nargs="+", default=[2**p for p in range(7, 17)])
    parser.add_argument("--flash-head-dims", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--flash-dtypes", nargs="+", choices=list(DTYPES), default=["bf16", "fp32"])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.attention times CUDA kernels: it needs a GPU")
    {"headline": headline, "flash": flash_sweep}[args.mode](args)


if __name__ == "__main__":
    main()
