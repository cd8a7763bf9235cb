"""dQ out of the one-pass backward's accumulator in one kernel: scaled, transposed and cast.

The Gluon backward (``backward``) adds each key tile's share of dQ, transposed and
without the softmax scale, into an fp32 accumulator (B·H, d, N_q rounded up to 4) by TMA reductions. Scaling it,
transposing it and casting it into dQ as PyTorch operations takes two passes over it; this is one, as cuDNN's own
conversion of its dQ accumulator is. Plain Triton: it runs in the
interpreter too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS = 64  # dQ rows a program


@triton.jit
def dq_from_accumulator_kernel(
    ACC, DQ, stride_acc_bh, stride_acc_d, stride_b, stride_h, stride_n, num_heads, n_q, scale,
    HEAD_DIM: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """DQ[b, h, n, :] = scale · ACC[b·H + h, :, n] in DQ's dtype, for ROWS rows n a program (grid (B·H, rows))."""
    bh = tl.program_id(0)
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, HEAD_DIM)
    inside = rows[:, None] < n_q
    acc = tl.load(ACC + bh.to(tl.int64) * stride_acc_bh + cols[None, :] * stride_acc_d + rows[:, None], mask=inside)
    b, h = bh // num_heads, bh % num_heads
    out = DQ + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h + rows[:, None] * stride_n + cols[None, :]
    tl.store(out, (acc * scale).to(DQ.dtype.element_ty), mask=inside)


def dq_from_accumulator(acc: torch.Tensor, dq4: torch.Tensor, scale: float) -> None:
    """Fill ``dq4`` (a (B, H, N_q, d) view, unit stride along d) with ``scale`` times the transpose of ``acc``
    ((B·H, d, ≥ N_q) fp32, unit stride along N)."""
    batch, heads, n_q, d = dq4.shape
    if acc.shape[:2] != (batch * heads, d) or acc.shape[2] < n_q or acc.stride(2) != 1 or dq4.stride(3) != 1:
        raise ValueError(
            f"the accumulator must be (B·H, d, >= N_q) = ({batch * heads}, {d}, >= {n_q}) with unit stride along N, "
            f"and dQ unit stride along d; got {tuple(acc.shape)} strides {acc.stride()}, dQ strides {dq4.stride()}"
        )
    dq_from_accumulator_kernel[(batch * heads, triton.cdiv(n_q, ROWS))](
        acc, dq4, acc.stride(0), acc.stride(1), dq4.stride(0), dq4.stride(1), dq4.stride(2), heads, n_q, scale,
        HEAD_DIM=d, ROWS=ROWS,
    )  # fmt: skip
