"""Float64 attention reference for the kernel tests, independent of the code under test."""

from __future__ import annotations

import math

import torch


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and logsumexp in float64, the whole score matrix at once.

    Causal queries are end-aligned (query i sees keys j <= i + N_k - N_q); a query that sees no key
    gets output 0 and logsumexp -inf, which is what the flash implementations document.
    """
    q, k, v = q.double(), k.double(), v.double()
    n_q, n_k = q.shape[-2], k.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (..., N_q, N_k)
    visible = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device)
    if is_causal:
        visible = torch.arange(n_k, device=q.device)[None, :] <= torch.arange(n_q, device=q.device)[:, None] + n_k - n_q
    sees_any = visible.any(dim=-1)  # (N_q,)
    # Empty rows attend everywhere and are then zeroed, so no NaN reaches the output or the gradients.
    scores = scores.masked_fill(~(visible | ~sees_any[:, None]), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v * sees_any[:, None]
    lse = torch.logsumexp(scores, dim=-1).masked_fill(~sees_any, float("-inf"))
    return out, lse.detach()


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖ / ‖expected‖ in float64 (NaN anywhere gives NaN, which fails any bound)."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm()).item()
