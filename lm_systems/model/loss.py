"""The LM head and cross-entropy as one op over chunks of tokens: the (tokens, vocab) logits never exist whole.

``fused_linear_cross_entropy(hidden, weight, targets)`` is ``F.cross_entropy(hidden @ weight.T, targets)`` (the mean
over tokens) computed a chunk of tokens at a time. With gradients on, forward also computes both input gradients: in
each chunk the logits' gradient, (softmax - one-hot) / N, overwrites the chunk's logits and goes straight into
grad_hidden = g @ W and grad_weight += gᵀ @ h. Backward only scales the two by grad_output, so no logits are kept for
it and the weight is not read after forward (ZeRO-3 frees its gathered LM head there). On a GPU each chunk's rows are
one Triton kernel (``lm_systems.model.loss_kernel``) that writes the gradient in place; peak extra memory is then one
chunk's logits in the compute dtype and the two gradients. Liger-Kernel's FusedLinearCrossEntropy is the same idea.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from lm_systems.model import loss_kernel
from lm_systems.model.loss_kernel import cross_entropy_rows_

# A chunk's float32 logits: 4,096 tokens at vocab 151,936, where smaller chunks ran slower on a GPU and larger ones no
# faster (benchmarks/results/fused_loss.md).
CHUNK_LOGITS_BYTES = 5 * 2**29
# How each chunk's softmax and gradient are computed: one Triton kernel in place, one compiled function, eager passes.
CHUNK_KERNELS = ("triton", "compiled", "eager")
# A 16-bit weight's gradient is summed in its own dtype when that rounds the sum at most this many times (bf16 keeps 8
# bits: the error stays within a few units of the last place); over more chunks it is summed in float32.
MAX_16BIT_SUMS = 8


def default_chunk_tokens(vocab: int) -> int:
    """Tokens per chunk: the most whose float32 logits fit CHUNK_LOGITS_BYTES, rounded down to a power of two (whole
    matmul tiles)."""
    tokens = max(1, CHUNK_LOGITS_BYTES // (4 * vocab))
    return 1 << (tokens.bit_length() - 1)


@torch.compiler.disable  # the chunk loop runs eagerly: a compiled model breaks its graph here
def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_tokens: int | None = None,
    *,
    chunk_kernel: str | None = None,
) -> torch.Tensor:
    """Mean over tokens of -log softmax(hidden @ weight.T)[target], without materialising the logits.

    hidden (N, D) and weight (V, D) are multiplied in the autocast dtype where autocast is on for their device, else
    in the weight's dtype; softmax statistics and the loss are float32, the gradients come out in each input's dtype.
    targets (N,) are int64 class indices in [0, V) (not checked: that would wait for the device). chunk_tokens: tokens
    per chunk, the last one what is left (default: default_chunk_tokens(V)). chunk_kernel: how each chunk's softmax,
    loss and gradient are computed, one of CHUNK_KERNELS: ``triton`` (one kernel, the gradient written over the
    logits in place; the default on a GPU), ``compiled`` (one torch.compile'd function) or ``eager`` (PyTorch ops; the
    default elsewhere). The gradients are computed in forward where either input requires one and grad mode is on;
    the graph's backward hands them over once (no second backward with retain_graph).
    """
    _check_inputs(hidden, weight, targets, chunk_tokens)
    chunk_kernel = chunk_kernel or ("triton" if hidden.is_cuda else "eager")
    _check_chunk_kernel(chunk_kernel, hidden)
    chunk_tokens = chunk_tokens or default_chunk_tokens(weight.shape[0])
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    with torch.autocast(device, enabled=False):  # the dtypes are chosen above, once
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            return _FusedLinearCrossEntropy.apply(hidden, weight, targets, chunk_tokens, dtype, chunk_kernel)
        return _loss(hidden.to(dtype), weight.to(dtype), targets, chunk_tokens, chunk_kernel)


def _check_chunk_kernel(chunk_kernel: str, hidden: torch.Tensor) -> None:
    if chunk_kernel not in CHUNK_KERNELS:
        raise ValueError(f"chunk_kernel must be one of {', '.join(CHUNK_KERNELS)}, got {chunk_kernel!r}")
    if chunk_kernel == "triton" and not hidden.is_cuda and not loss_kernel.INTERPRETED:
        raise ValueError(
            "chunk_kernel 'triton' needs a CUDA device (or TRITON_INTERPRET=1 set before triton is imported, to "
            "interpret it on the CPU); use 'eager' here"
        )


def _check_inputs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int | None) -> None:
    if hidden.ndim != 2 or hidden.shape[0] == 0:
        raise ValueError(
            f"hidden must be (tokens, d_model) with at least one token, got shape {tuple(hidden.shape)} "
            "(flatten batch and time first: hidden.flatten(0, 1))"
        )
    if weight.ndim != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be (vocab, d_model) = (V, {hidden.shape[1]}), got shape {tuple(weight.shape)}")
    if not (hidden.is_floating_point() and weight.is_floating_point()):
        raise ValueError(f"hidden and weight must be floating point, got {hidden.dtype} and {weight.dtype}")
    if targets.shape != hidden.shape[:1] or targets.dtype != torch.int64:
        raise ValueError(
            f"targets must be int64 of shape ({hidden.shape[0]},), one per token of hidden, got "
            f"{targets.dtype} of shape {tuple(targets.shape)}"
        )
    if not hidden.device == weight.device == targets.device:
        raise ValueError(
            f"hidden, weight and targets must be on one device, got {hidden.device}, {weight.device} "
            f"and {targets.device}"
        )
    if chunk_tokens is not None and (not isinstance(chunk_tokens, int) or chunk_tokens < 1):
        raise ValueError(f"chunk_tokens must be a positive int or None, got {chunk_tokens!r}")


def _token_losses(logits: torch.Tensor, targets: torch.Tensor, tokens: None = None) -> torch.Tensor:
    """-log softmax(logits)[target] of each row, in float32."""
    logits = logits.float()
    return torch.logsumexp(logits, dim=1) - logits.gather(1, targets[:, None]).squeeze(1)


def _token_losses_and_grad(logits: torch.Tensor, targets: torch.Tensor, tokens: int) -> torch.Tensor:
    """The rows' losses in float32; the gradient of the mean loss over ``tokens`` rows with respect to ``logits``,
    (softmax - one-hot) / N, written over ``logits`` in their dtype."""
    logits32 = logits.float()  # ``logits`` itself where they are float32
    lse = torch.logsumexp(logits32, dim=1)
    losses = lse - logits32.gather(1, targets[:, None]).squeeze(1)
    # -- softmax / N as exp(x - lse - log N): the 1/N costs no pass of its own over the chunk
    grad = logits32.sub_((lse + math.log(tokens))[:, None]).exp_()
    grad.scatter_add_(1, targets[:, None], grad.new_full((grad.shape[0], 1), -1.0 / tokens))
    logits.copy_(grad)
    return losses


@functools.cache
def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn)


def _chunk_function(chunk_kernel: str, with_grad: bool) -> Callable:
    """``fn(logits, targets, tokens)`` returning the rows' float32 losses; with_grad (``tokens`` given): also writing
    the gradient of the mean over ``tokens`` rows over ``logits``."""
    if chunk_kernel == "triton":
        return cross_entropy_rows_
    fn = _token_losses_and_grad if with_grad else _token_losses
    return _compiled(fn) if chunk_kernel == "compiled" else fn


def _loss(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int, chunk_kernel: str
) -> torch.Tensor:
    """The mean loss alone, ``hidden`` and ``weight`` already in the compute dtype: no gradient buffers."""
    token_losses = _chunk_function(chunk_kernel, with_grad=False)
    losses = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        losses[rows] = token_losses(hidden[rows] @ weight.T, targets[rows], None)  # (n, V) logits, one chunk
    return losses.mean()


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and both input gradients chunk by chunk; backward scales them by grad_output."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        chunk_tokens: int,
        dtype: torch.dtype,
        chunk_kernel: str,
    ) -> torch.Tensor:
        losses_and_grad = _chunk_function(chunk_kernel, with_grad=True)
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        h, w = hidden.to(dtype), weight.to(dtype)  # one cast each where the compute dtype differs
        tokens = h.shape[0]
        losses = torch.empty(tokens, dtype=torch.float32, device=h.device)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        chunks = -(-tokens // chunk_tokens)
        grad_weight = (
            torch.empty_like(weight, dtype=_weight_grad_sum_dtype(weight.dtype, chunks)) if need_weight else None
        )
        for start in range(0, tokens, chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            logits = h[rows] @ w.T  # (n, V)
            losses[rows] = losses_and_grad(logits, targets[rows], tokens)  # logits now hold their gradient
            if need_hidden:
                _matmul_into(grad_hidden[rows], logits, w, accumulate=False)
            if need_weight:
                _matmul_into(grad_weight, logits.T, h[rows], accumulate=start > 0)
            del logits  # before the next chunk makes its own
        ctx.gradients = (grad_hidden, grad_weight.to(weight.dtype) if need_weight else None)
        return losses.mean()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        if ctx.gradients is None:
            raise RuntimeError(
                "fused_linear_cross_entropy hands its gradients over once: a second backward through "
                "the same graph (retain_graph=True) is not supported; call it again instead"
            )
        grad_hidden, grad_weight = ctx.gradients
        ctx.gradients = None  # scaled in place: nothing else holds them
        for grad in (grad_hidden, grad_weight):
            if grad is not None:
                grad.mul_(grad_output)
        return grad_hidden, grad_weight, None, None, None, None


def _weight_grad_sum_dtype(weight_dtype: torch.dtype, chunks: int) -> torch.dtype:
    if weight_dtype.itemsize >= 4 or chunks <= MAX_16BIT_SUMS:
        return weight_dtype
    return torch.float32


def _matmul_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    """out = a @ b, or out += a @ b, with no temporary where ``out`` has the operands' dtype."""
    if out.dtype != a.dtype:
        out.add_(a @ b) if accumulate else out.copy_(a @ b)
    elif accumulate:
        out.addmm_(a, b)
    else:
        torch.mm(a, b, out=out)
