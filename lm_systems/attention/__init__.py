"""Attention implementations, looked up by name.

Every implementation is a function ``attn(q, k, v, is_causal) -> o`` over tensors shaped
``(..., N, d)`` (the model passes ``(B, H, N, d_head)``), scaled by ``1/sqrt(d)``. With
``is_causal`` and ``N_q != N_k`` the query block is aligned to the *end* of the keys
(query ``i`` sees keys ``j <= i + N_k - N_q``), as in decoding with a KV cache.
"""

import importlib.util

# Importing the implementations registers them.
from lm_systems.attention import naive as _naive  # noqa: F401
from lm_systems.attention import sdpa as _sdpa  # noqa: F401
from lm_systems.attention.flash_torch import FlashAttention2Torch
from lm_systems.attention.registry import (
    AttentionFn,
    attention_names,
    describe_attention,
    get_attention,
    register_attention,
    resolve_attention_name,
)

__all__ = [
    "AttentionFn",
    "FlashAttention2Torch",
    "attention_names",
    "describe_attention",
    "get_attention",
    "register_attention",
    "resolve_attention_name",
]

# Without triton installed, flash_triton is simply not registered (and ``auto`` falls back).
if importlib.util.find_spec("triton") is not None:
    from lm_systems.attention.flash_triton import FlashAttention2Triton  # noqa: F401  exported through __all__

    __all__.append("FlashAttention2Triton")
