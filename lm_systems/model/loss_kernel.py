"""A chunk's cross-entropy rows in one Triton kernel: each row's loss, and its logits overwritten by their gradient.

One program per row reads the row's logits (16- or 32-bit) twice and writes them once: a first pass keeps a running
maximum and sum of exponentials per lane (float32) and picks out the target's logit; the second writes
(softmax - one-hot) / N over the logits in their own dtype. Nothing the size of the chunk is allocated, where eager or
compiled PyTorch makes a float32 copy of it.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

MAX_BLOCK = 4096  # vocabulary entries a program reads at once


@triton.jit
def _cross_entropy_rows(
    logits_ptr,
    row_stride,
    targets_ptr,
    losses_ptr,
    vocab,
    log_tokens,
    inv_tokens,
    WRITE_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    target = tl.load(targets_ptr + row)
    lanes = tl.arange(0, BLOCK)
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_sum = tl.zeros([BLOCK], tl.float32)
    target_logit = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + lanes
        x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(lane_max, x)
        # A lane that has seen only padding keeps -inf; shifting by 0 there keeps its sum at exp(-inf) = 0, not NaN.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        lane_sum = lane_sum * tl.exp(lane_max - shift) + tl.exp(x - shift)
        lane_max = new_max
        target_logit += tl.where(cols == target, x, 0.0)
    row_max = tl.max(lane_max, axis=0)
    # Shifted by the row's maximum before anything is subtracted, so large logits lose no digits to cancellation.
    log_sum = tl.log(tl.sum(lane_sum * tl.exp(lane_max - row_max), axis=0))
    tl.store(losses_ptr + row, row_max - tl.sum(target_logit, axis=0) + log_sum)
    if WRITE_GRAD:
        offset = log_sum + log_tokens  # softmax / N as one exp: exp(x - max - log sum - log N)
        for start in range(0, vocab, BLOCK):
            cols = start + lanes
            mask = cols < vocab
            x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            grad = tl.exp(x - row_max - offset) - tl.where(cols == target, inv_tokens, 0.0)
            tl.store(row_ptr + cols, grad.to(logits_ptr.dtype.element_ty), mask=mask)


# Fixed when the kernel is defined: triton.jit builds an interpreted kernel iff TRITON_INTERPRET=1 then.
INTERPRETED = isinstance(_cross_entropy_rows, InterpretedFunction)


def cross_entropy_rows_(
    logits: torch.Tensor, targets: torch.Tensor, tokens: int | None = None, block: int | None = None
) -> torch.Tensor:
    """Each row's -log softmax(logits)[target] in float32. Given ``tokens`` (N, all chunks' rows together), also
    overwrites ``logits`` with the gradient of the mean loss over N rows, (softmax - one-hot) / N, in their dtype.

    logits (n, V) with unit stride along V; targets (n,) int64 in [0, V). block: vocabulary entries a program reads
    at once (a power of two; default the smallest covering V, at most MAX_BLOCK)."""
    if logits.ndim != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be (rows, vocab) with unit stride along vocab, got {tuple(logits.shape)}")
    rows, vocab = logits.shape
    block = block or min(MAX_BLOCK, triton.next_power_of_2(vocab))
    losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _cross_entropy_rows[(rows,)](
        logits,
        logits.stride(0),
        targets,
        losses,
        vocab,
        math.log(tokens or 1),
        1.0 / (tokens or 1),
        WRITE_GRAD=tokens is not None,
        BLOCK=block,
        num_warps=8 if block >= 2048 else 4,
    )
    return losses
