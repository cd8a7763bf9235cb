"""PyTorch's fused ``scaled_dot_product_attention`` (flash / memory-efficient / cuDNN / math backends)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from lm_systems.attention.registry import register_attention


@register_attention("sdpa")
def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """SDPA; a rectangular causal case uses the end-aligned (lower-right) bias, which keeps the fused backends."""
    if is_causal and q.shape[-2] != k.shape[-2]:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[-2], k.shape[-2]))
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
