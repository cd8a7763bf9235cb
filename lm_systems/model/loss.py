"""The LM head and cross-entropy as one op over chunks of tokens: the (tokens, vocab) logits never exist whole.

``fused_linear_cross_entropy(hidden, weight, targets)`` is ``F.cross_entropy(hidden @ weight.T, targets)`` (the mean
over tokens) computed a chunk of tokens at a time. With gradients on, forward also computes both input gradients: in
each chunk the logits' gradient, (softmax - one-hot) / N, overwrites the chunk's logits and goes straight into
grad_hidden = g @ W and grad_weight += gᵀ @ h. Backward only scales the two by grad_output, so no logits are kept for
it and the weight is not read after forward (ZeRO-3 frees its gathered LM head there). Peak extra memory: one chunk's
logits (and their float32 copy where the compute dtype is 16-bit), the two gradients, and for a 16-bit weight a float32
accumulator of its gradient and a 16-bit product buffer. Liger-Kernel's FusedLinearCrossEntropy is the same idea.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

# A chunk's float32 logits: 4,096 tokens at vocab 151,936. Fewer, larger chunks ran faster on a GPU, and 4,096 still
# took a third of the plain loss's memory at 32,768 tokens (benchmarks/results/fused_loss.md).
CHUNK_LOGITS_BYTES = 5 * 2**29


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
    compile_chunks: bool = False,
) -> torch.Tensor:
    """Mean over tokens of -log softmax(hidden @ weight.T)[target], without materialising the logits.

    hidden (N, D) and weight (V, D) are multiplied in the autocast dtype where autocast is on for their device, else
    in the weight's dtype; softmax statistics and the loss are float32, the gradients come out in each input's dtype.
    targets (N,) are int64 class indices in [0, V) (not checked: that would wait for the device). chunk_tokens: tokens
    per chunk, the last one what is left (default: default_chunk_tokens(V)). compile_chunks: run each chunk's
    elementwise work (logsumexp, softmax - one-hot, the loss) as one torch.compile'd function instead of eager passes
    over the chunk's logits. The gradients are computed in forward where either input requires one and grad mode is
    on; the graph's backward hands them over once (no second backward with retain_graph).
    """
    _check_inputs(hidden, weight, targets, chunk_tokens)
    chunk_tokens = chunk_tokens or default_chunk_tokens(weight.shape[0])
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    with torch.autocast(device, enabled=False):  # the dtypes are chosen above, once
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            return _FusedLinearCrossEntropy.apply(hidden, weight, targets, chunk_tokens, dtype, compile_chunks)
        return _loss(hidden.to(dtype), weight.to(dtype), targets, chunk_tokens, compile_chunks)


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


def _token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log softmax(logits)[target] of each row, in float32."""
    logits = logits.float()
    return torch.logsumexp(logits, dim=1) - logits.gather(1, targets[:, None]).squeeze(1)


def _token_losses_and_grad(
    logits: torch.Tensor, targets: torch.Tensor, log_tokens: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' losses in float32, and the gradient of the mean loss over all N = exp(log_tokens) tokens with respect
    to ``logits``, (softmax - one-hot) / N, written over ``logits`` in their dtype."""
    logits32 = logits.float()  # ``logits`` itself where they are float32
    lse = torch.logsumexp(logits32, dim=1)
    losses = lse - logits32.gather(1, targets[:, None]).squeeze(1)
    # -- softmax / N as exp(x - lse - log N): the 1/N costs no pass of its own over the chunk
    grad = logits32.sub_((lse + log_tokens)[:, None]).exp_()
    grad.scatter_add_(1, targets[:, None], grad.new_full((grad.shape[0], 1), -math.exp(-log_tokens)))
    return losses, logits.copy_(grad)


@functools.cache
def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn)


def _loss(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int, compile_chunks: bool
) -> torch.Tensor:
    """The mean loss alone, ``hidden`` and ``weight`` already in the compute dtype: no gradient buffers."""
    token_losses = _compiled(_token_losses) if compile_chunks else _token_losses
    losses = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        losses[rows] = token_losses(hidden[rows] @ weight.T, targets[rows])  # (n, V) logits, one chunk
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
        compile_chunks: bool,
    ) -> torch.Tensor:
        token_losses = _compiled(_token_losses_and_grad) if compile_chunks else _token_losses_and_grad
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        h, w = hidden.to(dtype), weight.to(dtype)  # one cast each where the compute dtype differs
        tokens = h.shape[0]
        losses = torch.empty(tokens, dtype=torch.float32, device=h.device)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # The weight's gradient sums every chunk's gᵀ @ h. A 16-bit running sum would round at each of the many
        # chunks (bf16 keeps 8 bits), so it is summed in float32 at least: at vocab 151,936 × d_model 4,096 that is
        # 2.5 GB, plus a 1.2 GB 16-bit product buffer, against 1.2 GB for a 16-bit sum.
        grad_weight = (
            torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, torch.float32)) if need_weight else None
        )
        product = torch.empty_like(w) if need_weight and w.dtype != grad_weight.dtype else None
        for start in range(0, tokens, chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            losses[rows], grad_logits = token_losses(h[rows] @ w.T, targets[rows], math.log(tokens))  # (n, V)
            if need_hidden:
                grad_hidden[rows] = grad_logits @ w  # cast to hidden's dtype on the copy
            if need_weight and product is None:
                grad_weight.addmm_(grad_logits.T, h[rows])
            elif need_weight:
                grad_weight.add_(torch.mm(grad_logits.T, h[rows], out=product))
            del grad_logits  # the chunk's logits, before the next chunk makes its own
        del product
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
