"""The autograd Function both FlashAttention-2 implementations are: save q, k, v, O and the logsumexp L, recompute
the rest in backward.

``flash_attention_function(name, compute_forward, compute_backward)`` returns the class to subclass::

    class FlashAttention2Torch(
        flash_attention_function("FlashAttention2Torch", flash_forward_torch, flash_backward_torch)
    ):
        '''...'''

``compute_forward(q, k, v, is_causal) -> (O, L)`` and
``compute_backward(q, k, v, O, L, dO, is_causal) -> (dQ, dK, dV)``;
the subclass's ``apply(q, k, v, is_causal=False)`` returns O and records backward for autograd.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch

Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor]]
Backward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def flash_attention_function(
    name: str, compute_forward: Forward, compute_backward: Backward, *, autocast_inputs: bool = False
) -> type[torch.autograd.Function]:
    """The autograd Function over ``compute_forward`` and ``compute_backward``, its ``apply`` a plain function.

    ``name``: the implementation's, which names its autograd node ``_<name>FunctionBackward`` (in ``grad_fn``,
    profiler traces and anomaly reports). Autograd names the node after the Function class as the class is made,
    so the class is made under that name: a class statement here would name every implementation's node alike.

    ``autocast_inputs``: under autocast, cast q, k, v to the autocast dtype first (what PyTorch does for its own
    attention), for kernels that take one dtype for all three and cannot follow autocast op by op.
    """

    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
        if autocast_inputs and torch.is_autocast_enabled(q.device.type):
            dtype = torch.get_autocast_dtype(q.device.type)
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        out, lse = compute_forward(q, k, v, is_causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.is_causal = is_causal
        return out

    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = compute_backward(q, k, v, out, lse, grad_out, ctx.is_causal)
        return dq, dk, dv, None

    Function = types.new_class(
        f"_{name}Function",
        (torch.autograd.Function,),
        exec_body=lambda body: body.update(forward=staticmethod(forward), backward=staticmethod(backward)),
    )

    class FunctionWithPlainApply(Function):
        @staticmethod
        def apply(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
            # A plain function around the inherited apply, so that torch.compile(Subclass.apply) compiles a frame
            # that calls an autograd Function, which Dynamo traces; Dynamo fails to compile the inherited
            # classmethod itself.
            return Function.apply(q, k, v, is_causal)

    return FunctionWithPlainApply
