"""Tune flash_triton ahead of a run: ``python -m lm_systems.attention.tune --seq 8192 --head-dim 64 --heads 16``.

Runs flash_triton's forward and backward once per shape on random inputs, so that each kernel's tile config is
chosen (every candidate compiled and timed) and stored in the tuning cache of this machine
(``lm_systems.attention.tuning``). Later processes, eager or under torch.compile, launch the stored
configs at once. A choice holds for a sequence-length bucket (the next power of two), a head dim, causality and
a dtype; batch and heads are not in the key, so tune with the run's own (the fastest tiles depend on how many
programs fill the GPU). Prints what each shape took: a shape already tuned takes seconds. On Hopper in half precision
flash_triton runs its Gluon kernels (``hopper``: the forward at head dim 128, the backward at 64 and 128), which have
nothing to tune.

    python -m lm_systems.attention.tune --seq 16384 --head-dim 64 128 --heads 16   # the headline shapes
    python -m lm_systems.attention.tune --seq 8192 --head-dim 64 --heads 16 --batch 2  # medium at context 8192
    python -m lm_systems.attention.tune --clear                                     # forget every choice
"""

from __future__ import annotations

import argparse
import time

import torch

from lm_systems.attention.tuning import CACHE_ENV, TuningCache, default_cache_dir

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def tune_shape(batch: int, heads: int, seq: int, head_dim: int, dtype: torch.dtype, causal: bool) -> float:
    """Seconds one forward + backward took at this shape, tuning included where nothing was stored."""
    from lm_systems.attention.flash_triton import FlashAttention2Triton

    q, k, v = (
        torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3)
    )
    torch.cuda.synchronize()
    start = time.perf_counter()
    FlashAttention2Triton.apply(q, k, v, causal).backward(torch.ones_like(q))
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[], help="sequence lengths (queries = keys)")
    parser.add_argument("--head-dim", type=int, nargs="+", default=[64])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--no-causal", dest="causal", action="store_false", help="tune non-causal attention")
    parser.add_argument("--clear", action="store_true", help="delete every stored choice first")
    args = parser.parse_args(argv)
    root = default_cache_dir()
    if root is None:
        raise SystemExit(f"the tuning cache is off (${CACHE_ENV}): nothing would be kept")
    if args.clear:
        print(f"deleted {TuningCache(root).clear()} tuned choices from {root}")
    if not args.seq:
        if not args.clear:
            parser.error("give --seq (and --head-dim, --heads, --batch) to tune, or --clear")
        return
    if not torch.cuda.is_available():
        raise SystemExit("tuning times the kernels on a GPU: run this on the machine that trains")
    for seq in args.seq:
        for head_dim in args.head_dim:
            seconds = tune_shape(args.batch, args.heads, seq, head_dim, DTYPES[args.dtype], args.causal)
            print(
                f"B{args.batch} H{args.heads} N{seq} d{head_dim} {args.dtype}"
                f"{' causal' if args.causal else ''}: {seconds:.1f} s",
                flush=True,
            )
    print(f"tuned choices in {root}")


if __name__ == "__main__":
    main()
