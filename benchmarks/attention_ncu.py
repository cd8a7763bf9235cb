"""One causal bf16 backward for Nsight Compute: ``python -m benchmarks.attention_ncu --impl NAME``.

``NAME`` is one of the headline's implementations (``benchmarks.attention``): ``flash_triton`` (on Hopper its Gluon
backward), ``flash_triton_portable`` (the portable kernels, tuned first) or ``sdpa_cudnn``. Inputs, the
forward and a first backward (compiling, tuning) run outside ``cudaProfilerStart``/``Stop``, so ``ncu
--profile-from-start off`` sees only the profiled backwards' kernels. ``.ci/gpu_attention.sh ncu`` runs it under
ncu for each implementation at the 8B model's attention shape (or with ``$NCU_ARGS``: ``--head-dim 64 --heads 16
--seq 16384``, the d 64 headline's).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from benchmarks.attention import _qkv, headline_environment, implementations

IMPLEMENTATIONS = ("flash_triton", "flash_triton_portable", "sdpa_cudnn")


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """--batch, --heads, --seq, --head-dim: the 8B model's attention shape by default."""
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--head-dim", type=int, default=128)


def causal_backward(name: str, args: argparse.Namespace) -> Callable[[], None]:
    """Implementation ``name``'s causal bf16 attention at the shape of ``args``, its forward and a first backward run
    (compiled and tuned there): a callable running one more backward, the inputs' gradients dropped first so that no
    accumulation joins it. Call it under ``headline_environment(name)``, as it was made."""
    q, k, v = _qkv(args.batch, args.heads, args.seq, args.seq, args.head_dim, torch.bfloat16)
    out = implementations([name])[name](q, k, v, True)
    grad_out = torch.randn_like(out)

    def backward() -> None:
        q.grad = k.grad = v.grad = None
        out.backward(grad_out, retain_graph=True)

    backward()
    torch.cuda.synchronize()
    return backward


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", choices=IMPLEMENTATIONS, required=True)
    add_shape_arguments(parser)
    parser.add_argument("--repeats", type=int, default=1, help="backwards profiled")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (and ncu around it: .ci/gpu_attention.sh ncu)")
    with headline_environment(args.impl):
        backward = causal_backward(args.impl, args)
        torch.cuda.profiler.start()
        for _ in range(args.repeats):
            backward()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    shape = f"B{args.batch} H{args.heads} N{args.seq} d{args.head_dim}"
    print(f"profiled {args.repeats} backward(s) of {args.impl} at {shape} causal bf16")


if __name__ == "__main__":
    main()
