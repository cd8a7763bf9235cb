"""The checks every attention implementation makes of q, k, v before it computes anything."""

from __future__ import annotations

import torch


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, caller: str) -> None:
    """Raise a ValueError naming the mismatch unless q, k, v are ``(..., N_q, d)``, ``(..., N_k, d)`` twice."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() < 2:
            raise ValueError(f"{caller}: {name} must be shaped (..., N, d), got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{caller}: {name} must be a floating-point tensor, got {t.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{caller}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{caller}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"{caller}: k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"{caller}: q {tuple(q.shape)} and k {tuple(k.shape)} must agree in leading dims and head dim "
            "(only the sequence length, dim -2, may differ)"
        )
    if q.shape[-2] == 0 or k.shape[-2] == 0 or q.shape[-1] == 0:
        raise ValueError(f"{caller}: empty sequence or head dim: q {tuple(q.shape)}, k {tuple(k.shape)}")
