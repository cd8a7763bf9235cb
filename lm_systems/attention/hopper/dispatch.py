"""When flash_triton takes the Hopper kernels, their launchers, and their ops for compiled graphs.

flash_triton's forward and backward run the Gluon kernels (``forward``, ``backward``) for a call on a CUDA device of
compute capability 9.x (wgmma and TMA; Blackwell has no wgmma), in fp16 or bf16, with q, k, v (and dO) in the layout
TMA descriptors need (``flash_triton.tma_loads``), the forward at head dim 128 (at 64 the portable forward is as fast:
docs/attention.md), the backward at 64 and 128; anywhere else, or with ``LM_SYSTEMS_FLASH_HOPPER=0``, the portable
kernels run. Eager calls launch the kernels directly; compiled graphs call them through their ops
(Inductor launches plain Triton kernels only, not Gluon's).

Gluon is imported on the first Hopper call: CPU runs (the interpreter tests, CI) never import it.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable

import torch
import triton

from lm_systems.attention.hopper.dq_conversion import dq_from_accumulator
from lm_systems.attention.hopper.ptx import HEAD_DIMS, MULTIPLE, backward_launch_options

HOPPER_ENV = "LM_SYSTEMS_FLASH_HOPPER"
HOPPER_SETTINGS = ("1", "0")
FORWARD_HEAD_DIMS = (128,)
BACKWARD_HEAD_DIMS = HEAD_DIMS
DTYPES = (torch.float16, torch.bfloat16)
FORWARD_ROWS = 128  # a forward program's query rows (two warpgroups of 64)
FORWARD_KEYS = 128  # a forward ring slot's keys
FORWARD_STAGES = 2  # ring slots
BACKWARD_KEYS = 128  # a backward program's keys (two warpgroups of 64)


def hopper_applies(
    views: tuple[torch.Tensor, ...], tma_layout_ok: Callable[[], bool], head_dims: tuple[int, ...]
) -> bool:
    """Whether the Gluon kernel of these ``head_dims`` (``FORWARD_HEAD_DIMS``, ``BACKWARD_HEAD_DIMS``) takes a call
    on these (B, H, N, d) views, q's first: see the module's docstring, and strides the backward's shipped PTX is
    specialised on (``strides_fit``). ``tma_layout_ok`` is asked last."""
    if hopper_setting() == "0":
        return False
    q = views[0]
    supported = q.is_cuda and q.dtype in DTYPES and q.shape[-1] in head_dims and is_hopper(q.device)
    return supported and strides_fit(views) and tma_layout_ok()


def hopper_setting() -> str:
    """``LM_SYSTEMS_FLASH_HOPPER``, checked: ``1`` (unset) or ``0``."""
    setting = os.environ.get(HOPPER_ENV, "1")
    if setting not in HOPPER_SETTINGS:
        raise ValueError(f"{HOPPER_ENV} must be 1 (the Hopper kernels where they apply: the default) or 0 (never), "
                         f"got {setting!r}")  # fmt: skip
    return setting


@functools.cache
def _is_sm90(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] == 9


@torch.compiler.assume_constant_result
def is_hopper(device: torch.device) -> bool:
    """Whether ``device`` is a Hopper GPU, asked while torch.compile traces a model: answered then, a constant in its
    graph."""
    return _is_sm90(device)


def _strides(x: torch.Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


def strides_fit(views: tuple[torch.Tensor, ...]) -> bool:
    """Whether every (B, H, N) stride of these views is what the backward's shipped PTX is specialised on: a
    multiple of ``ptx.MULTIPLE`` elements (true of any layout with a contiguous head dimension of 64 or 128; TMA alone
    needs 8)."""
    return not any(s % MULTIPLE for t in views for s in _strides(t))


@functools.cache
def descriptor_scratch(device: torch.device):
    """Triton's allocator for the global memory a kernel that builds tensor descriptors asks for at launch."""
    return lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device)


def _allocate_descriptor_scratch(device: torch.device) -> None:
    """Set ``descriptor_scratch``; per call: Triton keeps the allocator per thread, and the backward runs on
    autograd's."""
    triton.set_allocator(descriptor_scratch(device))


def hopper_forward(
    q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, out4: torch.Tensor, lse: torch.Tensor, is_causal: bool
) -> None:
    """Fill out4 (a (B, H, N_q, d) view) with attention of the (B, H, N, d) views q4, k4, v4, and ``lse`` (indexed
    (B·H, N_q)) with its logsumexp, as the portable forward does."""
    from lm_systems.attention.hopper.forward import gluon_forward_kernel

    _allocate_descriptor_scratch(q4.device)
    batch, heads, n_q, d = q4.shape
    gluon_forward_kernel[(triton.cdiv(n_q, FORWARD_ROWS), batch * heads)](
        q4, k4, v4, out4, lse,
        *_strides(q4), *_strides(k4), *_strides(v4), *_strides(out4),
        heads, n_q, k4.shape[2], 1.0 / math.sqrt(d),
        HEAD_DIM=d, CAUSAL=is_causal, BLOCK_N=FORWARD_KEYS, STAGES=FORWARD_STAGES, num_warps=4,
    )  # fmt: skip


def hopper_backward(
    q4: torch.Tensor,
    k4: torch.Tensor,
    v4: torch.Tensor,
    do4: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    dq4: torch.Tensor,
    dk4: torch.Tensor,
    dv4: torch.Tensor,
    is_causal: bool,
) -> None:
    """Fill dq4, dk4, dv4 (B, H, N, d views) from (B, H, N, d) views of q, k, v, dO, with the logsumexp ``lse`` and
    D = rowsum(dO ∘ O) ``delta``, both indexed (B·H, N_q) (copied side by side: ``row_statistics``): dK and dV
    stored by the kernel, dQ added (transposed, unscaled) into a zeroed fp32 accumulator by its TMA reductions, then
    scaled, transposed and cast into dq4."""
    from lm_systems.attention.hopper.backward import gluon_backward_kernel

    views = (q4, k4, v4, do4, dk4, dv4)
    if not strides_fit(views):  # flash_triton asks hopper_applies first; a direct call is told
        raise ValueError(f"the Hopper backward needs strides that are multiples of {MULTIPLE} elements, got "
                         f"{[s for t in views for s in _strides(t)]}")  # fmt: skip
    _allocate_descriptor_scratch(q4.device)
    batch, heads, n_q, d = q4.shape
    n_k = k4.shape[2]
    sm_scale = 1.0 / math.sqrt(d)
    # (B·H, d, N_q) with rows a multiple of 4 floats apart: TMA needs 16-byte strides.
    n_q_padded = triton.cdiv(n_q, 4) * 4
    dq_acc = torch.zeros(batch * heads, d, n_q_padded, dtype=torch.float32, device=q4.device)
    stats = row_statistics(lse, delta, batch * heads, n_q, n_q_padded)
    gluon_backward_kernel[(triton.cdiv(n_k, BACKWARD_KEYS), batch * heads)](
        q4, k4, v4, do4, stats, dk4, dv4, dq_acc,
        *(s for t in views for s in _strides(t)), dq_acc.stride(1), stats.stride(1), heads, n_q, n_k, sm_scale,
        **backward_launch_options(q4.dtype, is_causal, d),
    )  # fmt: skip
    dq_from_accumulator(dq_acc, dq4, sm_scale)


def row_statistics(lse: torch.Tensor, delta: torch.Tensor, heads: int, n_q: int, n_q_padded: int) -> torch.Tensor:
    """(B·H, 2, n_q_padded) fp32: each head's logsumexp in log2 units, then its D, rows 16-byte aligned for the
    backward's TMA copies (the padding is never read: the copies stop at n_q)."""
    stats = torch.empty(heads, 2, n_q_padded, dtype=torch.float32, device=lse.device)
    torch.mul(lse.reshape(heads, n_q), math.log2(math.e), out=stats[:, 0, :n_q])
    stats[:, 1, :n_q] = delta.reshape(heads, n_q)
    return stats


def _empty_like_each(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Empty contiguous tensors of these shapes, dtypes and devices."""
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors)


def _forward_outputs(q4: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """O (B, H, N_q, d) and L (B, H, N_q) float32, empty and contiguous."""
    return _empty_like_each(q4)[0], torch.empty(q4.shape[:-1], dtype=torch.float32, device=q4.device)


@torch.library.custom_op("lm_systems::flash_hopper_forward", mutates_args=())
def hopper_forward_op(
    q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, is_causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``hopper_forward`` as an op of its own, for flash_triton's compiled path: O and L of the (B, H, N, d) views,
    contiguous."""
    out4, lse = _forward_outputs(q4)
    hopper_forward(q4, k4, v4, out4, lse, is_causal)
    return out4, lse


@hopper_forward_op.register_fake
def _(q4, k4, v4, is_causal):
    return _forward_outputs(q4)


@torch.library.custom_op("lm_systems::flash_hopper_backward", mutates_args=())
def hopper_backward_op(
    q4: torch.Tensor,
    k4: torch.Tensor,
    v4: torch.Tensor,
    do4: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    is_causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``hopper_backward`` as an op of its own (flash_triton's backward calls it eager and compiled): dQ, dK, dV of
    the (B, H, N, d) views, contiguous."""
    grads = _empty_like_each(q4, k4, v4)
    hopper_backward(q4, k4, v4, do4, lse, delta, *grads, is_causal)
    return grads


@hopper_backward_op.register_fake
def _(q4, k4, v4, do4, lse, delta, is_causal):
    return _empty_like_each(q4, k4, v4)
