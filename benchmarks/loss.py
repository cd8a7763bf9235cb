"""The fused LM head + cross-entropy against the plain path: ``python -m benchmarks.loss --help``.

At vocab 151,936 and d_model 4,096 (an 8B model's head), hidden states and weight in bf16, for 8,192 and 32,768
tokens: forward + backward time and peak memory of

- ``plain``: ``F.cross_entropy((h @ W.T).float(), t)``, eager: the whole logits, in bf16 and float32, and their
  gradient;
- ``plain_compiled``: the same under ``torch.compile``;
- ``fused_triton``, ``fused_compiled``, ``fused_eager``: ``lm_systems.model.loss.fused_linear_cross_entropy`` with each
  ``chunk_kernel``: a chunk's softmax, loss and gradient as one Triton kernel writing in place (the default on a GPU),
  as one compiled function, as eager PyTorch passes;

the fused ones at the library's default chunk and at each ``--chunk-tokens``. Time: the median of ``--reps`` steps,
each between two device synchronisations, after ``--warmup`` untimed steps (compiling among them). Memory:
``torch.cuda.max_memory_allocated`` over one step from a reset, and that less what the inputs held before it. A variant
that runs out of GPU memory is a row marked OOM.

    python -m benchmarks.loss                                            # the 8B head on a GPU
    python -m benchmarks.loss --device cpu --tokens 48 --vocab 300 --d-model 32 --chunk-tokens 16 \
        --variants plain fused_eager                                     # a CPU check
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.device import add_device_arg, allocated_gib, free_memory, peak_memory_gib, reset_peak_memory, timed
from benchmarks.report import argument_parser, write_results
from lm_systems.model.loss import CHUNK_KERNELS, default_chunk_tokens, fused_linear_cross_entropy

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
COLUMNS = (
    "tokens",
    "variant",
    "chunk_tokens",
    "status",
    "median_ms",
    "min_ms",
    "vs_plain",
    "peak_GiB",
    "extra_GiB",
    "loss",
)


def plain_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy((hidden @ weight.T).float(), targets)  # (N, V) logits, whole


@functools.cache
def _compiled_plain_loss() -> LossFn:
    return torch.compile(plain_loss)


def _fused(kernel: str) -> Callable[[int | None], LossFn]:
    return lambda chunk: functools.partial(fused_linear_cross_entropy, chunk_tokens=chunk, chunk_kernel=kernel)


VARIANTS: dict[str, Callable[[int | None], LossFn]] = {  # name → loss function at a chunk size
    "plain": lambda chunk: plain_loss,
    "plain_compiled": lambda chunk: _compiled_plain_loss(),
    **{f"fused_{kernel}": _fused(kernel) for kernel in CHUNK_KERNELS},
}


def measure(
    loss_fn: LossFn,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    warmup: int,
    reps: int,
    device: torch.device,
) -> dict:
    """Forward + backward of ``loss_fn``: status, median and min ms, peak and extra GiB, the loss; 'OOM' if it ran
    out."""

    def step() -> torch.Tensor:
        hidden.grad = weight.grad = None
        loss = loss_fn(hidden, weight, targets)
        loss.backward()
        return loss

    try:
        for _ in range(warmup):
            step()
        hidden.grad = weight.grad = None
        inputs = allocated_gib(device)
        reset_peak_memory(device)
        loss = step().item()
        peak = peak_memory_gib(device)
        times = [timed(step, device) * 1e3 for _ in range(reps)]
    except torch.cuda.OutOfMemoryError:
        return {"status": "OOM"}
    finally:
        hidden.grad = weight.grad = None
        free_memory(device)
    return {
        "status": "ok",
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "peak_GiB": peak,
        "extra_GiB": peak - inputs,
        "loss": loss,
    }


def _inputs(tokens: int, vocab: int, d_model: int, dtype: torch.dtype, device: torch.device):
    hidden = torch.randn(tokens, d_model, device=device, dtype=dtype, requires_grad=True)
    # Scaled as an initialised head is, so the logits are of order one.
    weight = (torch.randn(vocab, d_model, device=device) / d_model**0.5).to(dtype).requires_grad_()
    return hidden, weight, torch.randint(0, vocab, (tokens,), device=device)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argument_parser(__doc__)
    add_device_arg(parser)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768], help="tokens per step (N)")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--d-model", type=int, default=4096)
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="of the hidden states and the weight")
    parser.add_argument(
        "--chunk-tokens",
        type=int,
        nargs="*",
        default=[512, 4096],
        help="fused chunk sizes measured besides the library's default for --vocab",
    )
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compiling among them)")
    parser.add_argument("--reps", type=int, default=10, help="timed steps")
    parser.add_argument("--name", default="fused_loss", help="file name of the results (<name>.csv, <name>.md)")
    args = parser.parse_args(argv)

    chunks = list(dict.fromkeys([default_chunk_tokens(args.vocab), *args.chunk_tokens]))
    rows = []
    for tokens in args.tokens:
        inputs = _inputs(tokens, args.vocab, args.d_model, DTYPES[args.dtype], args.device)
        plain_ms = None
        for variant in args.variants:
            # A chunk longer than the step is the whole step: measured once, under the size it runs at.
            for chunk in [None] if variant.startswith("plain") else dict.fromkeys(min(c, tokens) for c in chunks):
                row = {
                    "tokens": tokens,
                    "variant": variant,
                    "chunk_tokens": "" if chunk is None else chunk,
                    **measure(VARIANTS[variant](chunk), *inputs, args.warmup, args.reps, args.device),
                }
                if variant == "plain":
                    plain_ms = row.get("median_ms")
                row["vs_plain"] = plain_ms / row["median_ms"] if plain_ms and "median_ms" in row else ""
                rows.append(row)
                print(f"N={tokens} {variant} chunk={chunk}: {row['status']} {row.get('median_ms', '')}", flush=True)
        inputs = None
        free_memory(args.device)

    logits_gib = ", ".join(f"{t}: {t * args.vocab * 4 / 2**30:.1f}" for t in args.tokens)
    write_results(
        args.name,
        rows,
        f"Fused LM head + cross-entropy: vocab {args.vocab}, d_model {args.d_model}, {args.dtype}, forward + backward",
        notes=f"Median and min of {args.reps} steps after {args.warmup} untimed ones, each timed between two device "
        "synchronisations. peak_GiB: max_memory_allocated over one step from a reset; extra_GiB: that less what the "
        "inputs held before the step (the gradients of hidden and weight are among the extra). vs_plain: the eager "
        "plain step's time over this one (above 1 is faster). chunk_tokens "
        f"{default_chunk_tokens(args.vocab)} is the library's default at this vocabulary (where it is no longer than "
        f"the step). For scale, the float32 logits of the whole step, GiB by tokens: {logits_gib}.",
        columns=COLUMNS,
        out_dir=args.out_dir,
    )
    return rows


if __name__ == "__main__":
    main()
