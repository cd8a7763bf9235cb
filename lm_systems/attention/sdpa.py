"""PyTorch's fused ``scaled_dot_product_attention`` (flash / memory-efficient / cuDNN / math backends)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lm_systems.attention.naive import causal_mask
from lm_systems.attention.registry import register_attention


@register_attention("sdpa")
def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """SDPA; a rectangular causal case gets an explicit end-aligned mask (SDPA aligns to the start)."""
    if is_causal and q.shape[-2] != k.shape[-2]:
        mask = causal_mask(q.shape[-2], k.shape[-2], q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
