"""Attention written out in PyTorch: the reference every kernel is checked against."""

from __future__ import annotations

import math

import torch

from lm_systems.attention.registry import register_attention
from lm_systems.profiling.nvtx import nvtx_range


def causal_mask(n_q: int, n_k: int, device: torch.device) -> torch.Tensor:
    """Boolean (n_q, n_k) mask, True where query i may see key j (queries aligned to the last keys)."""
    q_idx = torch.arange(n_q, device=device)[:, None] + (n_k - n_q)
    k_idx = torch.arange(n_k, device=device)[None, :]
    return k_idx <= q_idx


@register_attention("naive")
def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """softmax(q kᵀ / sqrt(d) + mask) v, materialising the (N_q, N_k) score matrix."""
    with nvtx_range("attention/scores"):
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (..., N_q, N_k)
        if is_causal:
            scores = scores.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    with nvtx_range("attention/softmax"):
        probs = torch.softmax(scores, dim=-1)
    with nvtx_range("attention/weighted_sum"):
        return probs @ v  # (..., N_q, d)
