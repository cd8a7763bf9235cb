"""Activation checkpointing: which of a Transformer block's activations backward keeps, and which it recomputes.

Policies, by name (``--model.activation_checkpointing``):

- ``none``: backward keeps every activation the forward saved.
- ``blocks``: backward keeps only each block's input and runs the block's forward again to get the rest; the
  activations of one block at a time are alive in backward. Costs one more forward of the blocks.
- ``selective``: the block's matrix products and attention are kept, the cheap elementwise work between them (norms,
  rotary embedding, SiLU, products) is recomputed: most of the memory of ``none`` goes to those matmul outputs, so
  this saves less than ``blocks`` for a fraction of its extra work.

Both recomputing policies use torch's non-reentrant ``torch.utils.checkpoint`` (``create_selective_checkpoint_contexts``
for ``selective``), which works eagerly and inside torch.compile, and give the gradients of ``none``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

RECOMPUTE_POLICIES = ("none", "blocks", "selective")

_aten = torch.ops.aten
# The outputs ``selective`` keeps: matrix products and the attention kernels (their outputs and softmax statistics).
_KEPT_OPS = {
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
}
_KEPT_OP_NAMES = ("lm_systems::flash_attention_forward",)  # the Triton kernel's op under torch.compile


def _keep_matmuls_and_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if op in _KEPT_OPS or (isinstance(op, torch._ops.OpOverload) and op.name() in _KEPT_OP_NAMES):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_keep_matmuls_and_attention)


def run_with_recompute(forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, policy: str) -> torch.Tensor:
    """``forward(x)``, its activations kept for backward as ``policy`` says (``policy`` is one of RECOMPUTE_POLICIES,
    checked where the model's configuration is made)."""
    if policy == "none" or not torch.is_grad_enabled():  # outside autograd nothing is saved anyway
        return forward(x)
    if policy == "selective":
        return checkpoint(forward, x, use_reentrant=False, context_fn=_selective_contexts)
    return checkpoint(forward, x, use_reentrant=False)
