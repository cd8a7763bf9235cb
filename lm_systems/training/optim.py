"""AdamW's parameter groups for a TransformerLM: weight decay on the matrices, none on norms and embeddings."""

from __future__ import annotations

import torch
from torch import nn

from lm_systems.model.transformer import RMSNorm


def adamw_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups of the trainable parameters: matrices (decayed) and norms, embeddings, vectors (not decayed)."""
    decay, no_decay = [], []
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if not param.requires_grad:
                continue
            is_norm_or_embedding = isinstance(module, (RMSNorm, nn.Embedding))
            (no_decay if is_norm_or_embedding or param.ndim < 2 else decay).append(param)
    # The names label the groups in the optimizer's state (and in checkpoints); their learning rates are the same.
    return [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]


def fused_adamw_possible(param_groups: list[dict]) -> bool:
    """Fused AdamW (one kernel for the whole update) needs every parameter on a CUDA device."""
    return all(p.is_cuda for group in param_groups for p in group["params"])


def make_adamw(param_groups: list[dict], lr: float, betas: tuple[float, float]) -> torch.optim.AdamW:
    """AdamW over ``param_groups``, fused where the parameters allow it."""
    return torch.optim.AdamW(param_groups, lr=lr, betas=tuple(betas), fused=fused_adamw_possible(param_groups))
