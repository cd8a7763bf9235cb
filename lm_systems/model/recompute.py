"""Activation checkpointing: which of a Transformer block's activations backward keeps, and which it recomputes.

Policies, by name (``--model.activation_checkpointing``):

- ``none``: backward keeps every activation the forward saved.
- ``blocks``: backward keeps only each block's input and runs the block's forward again to get the rest; the
  activations of one block at a time are alive in backward. Costs one more forward of the blocks.
- ``keep_attention``: as ``blocks``, but each block's attention output (and its softmax statistics) is kept: at long
  context attention is the costliest work to redo for the bytes it keeps (its FLOPs grow with T², its output with T:
  at T 32,768 and d_model 4,096, about 33 kFLOP a byte against about 4 kFLOP a byte for a projection's output).
- ``selective``: the block's matrix products and attention are kept, the cheap elementwise work between them (norms,
  rotary embedding, SiLU, products) is recomputed: most of the memory of ``none`` goes to those matmul outputs, so
  this saves less than ``blocks`` for a fraction of its extra work.
- ``keep_projections``: as ``selective``, less the feed-forward's output projection (w2), the one matrix product
  that reads d_ff-wide input: only the residual sum reads its output, which backward never needs, so the recompute
  stops before it. The same work as ``selective`` for one (B, T, d_model) tensor less a block.

The recomputing policies use torch's non-reentrant ``torch.utils.checkpoint`` (``create_selective_checkpoint_contexts``
for those that keep some outputs), which works eagerly and inside torch.compile, and give the gradients of ``none``.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lm_systems.compat.torch import sdpa_kernel_ops

RECOMPUTE_POLICIES = ("none", "blocks", "keep_attention", "keep_projections", "selective")
RECOMPUTE_CHOICES = (*RECOMPUTE_POLICIES, "auto")
"""What ``--model.activation_checkpointing`` takes: a policy for every block, or ``auto``, a policy per block chosen
for a memory budget (``lm_systems.model.memory_budget``)."""
AUTO_WITHOUT_PLAN = "blocks"
"""What ``auto`` keeps in every block where no plan was made (no card to take a fractional budget of, no trainer)."""

_aten = torch.ops.aten
_MATMUL_OPS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default}


@functools.cache
def _attention_ops() -> frozenset:
    """SDPA's kernels, and the Triton kernel's forward op where triton is installed (it is what torch.compile sees)."""
    ops = sdpa_kernel_ops()
    triton_forward = getattr(torch.ops.lm_systems, "flash_attention_forward", None)
    return frozenset(ops | {triton_forward.default} if triton_forward is not None else ops)


def _is_attention(op) -> bool:
    return op in _attention_ops()


def _keep_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if _is_attention(op) else CheckpointPolicy.PREFER_RECOMPUTE


def _keep_matmuls_and_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if op in _MATMUL_OPS or _is_attention(op):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _keep_projections_and_attention(d_model: int, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Attention and the matrix products whose input is d_model wide (qkv, out, w1, w3; not w2, which reads d_ff)."""
    if _is_attention(op) or (op in _MATMUL_OPS and args[1 if op is _aten.addmm.default else 0].shape[-1] == d_model):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_KEPT = {"keep_attention": _keep_attention, "selective": _keep_matmuls_and_attention}


def run_with_recompute(forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, policy: str) -> torch.Tensor:
    """``forward(x)``, its activations kept for backward as ``policy`` says (``policy`` is one of RECOMPUTE_POLICIES,
    checked where the model's configuration is made)."""
    if policy == "none" or not torch.is_grad_enabled():  # outside autograd nothing is saved anyway
        return forward(x)
    if policy in _KEPT or policy == "keep_projections":
        kept = _KEPT.get(policy) or functools.partial(_keep_projections_and_attention, x.shape[-1])
        contexts = functools.partial(create_selective_checkpoint_contexts, kept)
        return checkpoint(forward, x, use_reentrant=False, context_fn=contexts)
    return checkpoint(forward, x, use_reentrant=False)
