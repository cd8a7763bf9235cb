"""FlashAttention2Triton: the Triton kernels as an autograd Function, registered as ``flash_triton``.

``FlashAttention2Triton.apply(q, k, v, is_causal=False)`` takes q (..., N_q, d) and k, v (..., N_k, d)
in fp16, bf16 or fp32 on a CUDA device, 16 <= d <= 128 (any d: it is padded to a power of two
inside the kernels), any N_q and N_k. It saves q, k, v, O and the logsumexp L (shape
``q.shape[:-1]``, float32) for backward. Under autocast the inputs are cast to the autocast dtype,
as PyTorch does for its own attention. Works inside ``torch.compile``.

Causal attention with N_q != N_k aligns queries to the end of the keys (query i sees keys
j <= i + N_k - N_q); a query that sees no key gets a zero output and L = -inf.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any, NamedTuple

import torch
import triton
from torch.library import triton_op, wrap_triton

from lm_systems.attention.eager_launch import CachedLaunch
from lm_systems.attention.flash_function import flash_attention_function
from lm_systems.attention.flash_triton_backward import attn_bwd_preprocess_kernel
from lm_systems.attention.hopper.dispatch import (
    BACKWARD_HEAD_DIMS,
    FORWARD_HEAD_DIMS,
    descriptor_scratch,
    hopper_applies,
    hopper_backward_op,
    hopper_forward,
    hopper_forward_op,
)
from lm_systems.attention.inputs import check_attention_inputs
from lm_systems.attention.registry import register_attention
from lm_systems.attention.tuning import TUNED_FOR_COMPILE, TUNED_FOR_EAGER, interpreting
from lm_systems.compat.torch import dispatch_mode_active

MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 128
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
PREPROCESS_BLOCK = 64  # rows per program of the memory-bound D = rowsum(dO ∘ O) kernel
# Grid order: heads-first grids (B·H, tiles) launch the longest causal tiles of every head first, so
# the tail of a launch holds only short programs; tiles-first grids (tiles, B·H) keep fewer heads' K and
# V in flight, which pays at d = 128 (docs/attention.md gives the A/B of the two orders that set the threshold).
HEADS_FIRST_MAX_HEAD_DIM = 64
# The backward passes load their tiles through tensor descriptors (TMA) on GPUs of compute capability 9 (Hopper)
# and newer. Set to "0" for pointer loads everywhere, "1" for descriptors wherever the layout allows, the CPU
# interpreter included.
TMA_ENV = "LM_SYSTEMS_FLASH_TMA"
TMA_MIN_CAPABILITY = 9
TMA_ALIGNMENT = 16  # bytes: a descriptor's base address and row strides


def check_triton_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise a ValueError naming what to change unless the Triton kernels can take q, k, v."""
    check_attention_inputs(q, k, v, "FlashAttention2Triton")
    d = q.shape[-1]
    if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
        raise ValueError(
            f"FlashAttention2Triton supports head dims {MIN_HEAD_DIM}..{MAX_HEAD_DIM}, got {d}: change "
            "model.d_model / model.num_heads, or use attention='flash_torch' or 'sdpa'"
        )
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"FlashAttention2Triton supports float16, bfloat16 and float32 inputs, got {q.dtype}")
    problem = _device_problem(q.device.type)
    if problem is not None:
        raise ValueError(
            f"FlashAttention2Triton cannot take {q.device.type} tensors: {problem}; move the inputs to a GPU or use "
            "attention='sdpa'"
        )


def _device_problem(device_type: str) -> str | None:
    """Why the kernels cannot run on ``device_type``, or None where they can: the one rule behind both the check
    at the door (the registry's ``device_problem``, before a run prepares anything) and the per-call check above."""
    if device_type == "cuda" or interpreting():
        return None
    return (
        "its Triton kernels need a CUDA GPU (or TRITON_INTERPRET=1 set before triton is imported, Triton's slow CPU "
        "interpreter)"
    )


def _as_bhnd(x: torch.Tensor) -> torch.Tensor:
    """(..., N, d) → a (B, H, N, d) view (a copy only if the leading dims cannot merge or d is strided)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 2:
        return x[None, None]
    if x.dim() == 3:
        return x[:, None]
    return x.reshape(-1, *x.shape[-3:])


def _strides(x: torch.Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


def _kernel_dims(d: int, n_q: int, n_k: int) -> dict:
    return {
        "N_Q_KEY": triton.next_power_of_2(n_q),
        "N_K_KEY": triton.next_power_of_2(n_k),
        "HEAD_DIM": d,
        "HEAD_DIM_PAD": max(16, triton.next_power_of_2(d)),
        "HEADS_FIRST": d <= HEADS_FIRST_MAX_HEAD_DIM,
    }


def _grid(n: int, block: str, batch_heads: int, heads_first: bool):
    """The launch grid over ``n`` rows in tiles of ``meta[block]``, for every (batch, head)."""

    def grid(meta):
        tiles = triton.cdiv(n, meta[block])
        return (batch_heads, tiles) if heads_first else (tiles, batch_heads)

    return grid


def tma_loads(tensors: tuple[torch.Tensor, ...], addresses_known: bool) -> bool:
    """Whether the backward passes load tiles of these (B, H, N, d) views through tensor descriptors: on a GPU that
    has TMA (or as ``TMA_ENV`` says), for a power-of-two head dim whose rows and (batch, head) offsets are 16-byte
    aligned. ``addresses_known``: the tensors are real (eager); under torch.compile only their storage offsets are
    known, and the buffers Inductor allocates are aligned."""
    setting = os.environ.get(TMA_ENV, "auto")
    if setting not in ("auto", "0", "1"):
        raise ValueError(f"{TMA_ENV} must be 0, 1 or unset (auto), got {setting!r}")
    q = tensors[0]
    if setting == "0" or (setting == "auto" and not (q.is_cuda and _has_tma(q.device))):
        return False
    d = q.shape[-1]
    if d != triton.next_power_of_2(d):
        return False
    for t in tensors:
        size = t.element_size()
        offsets = (*t.stride()[:3], t.storage_offset())
        if t.stride(2) <= 0 or any(offset * size % TMA_ALIGNMENT for offset in offsets):
            return False
        if addresses_known and t.data_ptr() % TMA_ALIGNMENT:
            return False
    return True


@functools.cache
def _has_tma(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= TMA_MIN_CAPABILITY


class _Kernels(NamedTuple):
    """The four kernels of one launch path."""

    fwd: Any
    preprocess: Any
    dkdv: Any
    dq: Any


# Eager calls launch each kernel through its TunedKernel once per launch key (its tile config tuned once per
# machine), then the compiled kernel directly (CachedLaunch). Under torch.compile each pass is a ``triton_op``
# whose ``triton.autotune`` kernels are wrapped with ``wrap_triton``: Inductor sees the Triton kernels themselves,
# tunes each one once for the graph's shapes (over the same pruned candidates, or takes the choice stored on this
# machine) and launches them from its generated code, without the dispatcher round trip or Triton's Python
# autotuner and launcher on every call.
def _kernel_set(wrap: Any, tuned: dict[str, Any]) -> _Kernels:
    """The four kernels in launch order, each wrapped by ``wrap`` (the preprocess kernel needs no tuning)."""
    kernels = (tuned["fwd"], attn_bwd_preprocess_kernel, tuned["dkdv"], tuned["dq"])
    return _Kernels(*(wrap(kernel) for kernel in kernels))


_EAGER_KERNELS = _kernel_set(CachedLaunch, TUNED_FOR_EAGER)
_COMPILED_KERNELS = _kernel_set(wrap_triton, TUNED_FOR_COMPILE)


def _forward(
    kernels: _Kernels, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    q4, k4, v4 = _as_bhnd(q), _as_bhnd(k), _as_bhnd(v)
    batch, heads, n_q, d = q4.shape
    n_k = k4.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)  # indexed as (B·H, N_q)
    out4 = _as_bhnd(out)
    eager = kernels is _EAGER_KERNELS  # real tensors; under torch.compile they are fakes
    views = (q4, k4, v4, out4)
    if hopper_applies(views, lambda: tma_loads(views, addresses_known=eager), FORWARD_HEAD_DIMS):
        if not eager:  # the Gluon kernels on sm_90 (hopper.dispatch); compiled, through their op
            out4, lse4 = hopper_forward_op(q4, k4, v4, is_causal)
            return out4.view(q.shape), lse4.view(q.shape[:-1])
        hopper_forward(q4, k4, v4, out4, lse, is_causal)
        return out, lse

    dims = _kernel_dims(d, n_q, n_k)
    kernels.fwd[_grid(n_q, "BLOCK_M", batch * heads, dims["HEADS_FIRST"])](
        q4,
        k4,
        v4,
        out4,
        lse,
        *_strides(q4),
        *_strides(k4),
        *_strides(v4),
        *_strides(out4),
        heads,
        n_q,
        n_k,
        1.0 / math.sqrt(d),
        CAUSAL=is_causal,
        **dims,
    )
    return out, lse


def _backward(
    kernels: _Kernels,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    is_causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q4, k4, v4, o4, do4 = _as_bhnd(q), _as_bhnd(k), _as_bhnd(v), _as_bhnd(out), _as_bhnd(grad_out)
    batch, heads, n_q, d = q4.shape
    n_k = k4.shape[2]
    dims = _kernel_dims(d, n_q, n_k)
    sm_scale = 1.0 / math.sqrt(d)
    eager = kernels is _EAGER_KERNELS  # real tensors; under torch.compile they are fakes
    tma = tma_loads((q4, k4, v4, do4), addresses_known=eager)

    delta = torch.empty((batch, heads, n_q), dtype=torch.float32, device=q.device)
    kernels.preprocess[(triton.cdiv(n_q, PREPROCESS_BLOCK), batch * heads)](
        o4,
        do4,
        delta,
        *_strides(o4),
        *_strides(do4),
        heads,
        n_q,
        HEAD_DIM=d,
        HEAD_DIM_PAD=dims["HEAD_DIM_PAD"],
        BLOCK_M=PREPROCESS_BLOCK,
    )
    if hopper_applies((q4, k4, v4, do4), lambda: tma, BACKWARD_HEAD_DIMS):  # on sm_90 (hopper.dispatch), through its op
        grads = hopper_backward_op(q4, k4, v4, do4, lse, delta, is_causal)
        return tuple(g.view(t.shape) for g, t in zip(grads, (q, k, v), strict=True))
    if tma and eager and not interpreting():
        # Per call: Triton keeps the allocator per thread, and backward runs on autograd's. Inductor sets its own.
        triton.set_allocator(descriptor_scratch(q.device))
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=q.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=q.device)
    dq4, dk4, dv4 = _as_bhnd(dq), _as_bhnd(dk), _as_bhnd(dv)

    kernels.dkdv[_grid(n_k, "BLOCK_N", batch * heads, dims["HEADS_FIRST"])](
        q4,
        k4,
        v4,
        do4,
        lse,
        delta,
        dk4,
        dv4,
        *_strides(q4),
        *_strides(k4),
        *_strides(v4),
        *_strides(do4),
        *_strides(dk4),
        *_strides(dv4),
        heads,
        n_q,
        n_k,
        sm_scale,
        CAUSAL=is_causal,
        TMA=tma,
        **dims,
    )
    kernels.dq[_grid(n_q, "BLOCK_M", batch * heads, dims["HEADS_FIRST"])](
        q4,
        k4,
        v4,
        do4,
        lse,
        delta,
        dq4,
        *_strides(q4),
        *_strides(k4),
        *_strides(v4),
        *_strides(do4),
        *_strides(dq4),
        heads,
        n_q,
        n_k,
        sm_scale,
        CAUSAL=is_causal,
        TMA=tma,
        **dims,
    )
    return dq, dk, dv


def _kernels_for(q: torch.Tensor) -> _Kernels:
    """The kernels the ops launch: traced by torch.compile (fake or functional tensors), those ``wrap_triton`` hands
    to Inductor; called on real tensors (eager, under a dispatch mode), the eager kernels a direct call launches."""
    return _EAGER_KERNELS if type(q) is torch.Tensor else _COMPILED_KERNELS


def _through_ops() -> bool:
    """Whether attention runs as its torch ops rather than launching its kernels directly: inside torch.compile,
    whose graphs hold the ops, and under a TorchDispatchMode, which sees ops only (the selective activation
    checkpointing policies keep attention's output by its forward op). Plain eager calls launch directly: the
    dispatcher's round trip would be host time on every call."""
    return torch.compiler.is_compiling() or dispatch_mode_active()


@triton_op("lm_systems::flash_attention_forward", mutates_args=())
def _forward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(_kernels_for(q), q, k, v, is_causal)


@triton_op("lm_systems::flash_attention_backward", mutates_args=())
def _backward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    is_causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(_kernels_for(q), q, k, v, out, lse, grad_out, is_causal)


def flash_forward_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """O shaped like q and the logsumexp L shaped ``q.shape[:-1]`` (float32)."""
    check_triton_inputs(q, k, v)
    if _through_ops():
        return _forward_op(q, k, v, is_causal)
    return _forward(_EAGER_KERNELS, q, k, v, is_causal)


def flash_backward_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    is_causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV: the D preprocess, then the dK/dV pass and the dQ pass."""
    grad_out = grad_out.to(q.dtype)
    if _through_ops():
        return _backward_op(q, k, v, out, lse, grad_out, is_causal)
    return _backward(_EAGER_KERNELS, q, k, v, out, lse, grad_out, is_causal)


class FlashAttention2Triton(
    flash_attention_function("FlashAttention2Triton", flash_forward_triton, flash_backward_triton, autocast_inputs=True)
):
    """FlashAttention-2 with Triton kernels for forward and backward:
    ``FlashAttention2Triton.apply(q, k, v, is_causal)``; saves only L beside q, k, v, O."""


# The longest sequence ``auto`` gives flash_triton on any GPU: compiled through train.py, the step with flash_triton
# is faster than sdpa's at contexts up to 2048 and slower at 8192, where sdpa's kernel leads
# (benchmarks/results/train_step.md, long_context.md).
AUTO_MAX_SEQ_LEN = 2048
# The shortest from which it gives flash_triton again where its Hopper kernels take the queries: from 16,384
# positions its forward and backward (at d 64 the portable forward, the Gluon backward) are at cuDNN's speed or
# above, and so is the 8B step at 32,768 (benchmarks/results/attention_hopper_gluon_h200.md); between, sdpa stays:
# nothing there was measured.
AUTO_HOPPER_MIN_SEQ_LEN = 16384


def _faster_when_compiled(q: torch.Tensor) -> bool:
    """Where ``auto`` takes flash_triton inside torch.compile: fp16 / bf16 on CUDA, in the kernels' head dims, up to
    ``AUTO_MAX_SEQ_LEN`` query positions, or from ``AUTO_HOPPER_MIN_SEQ_LEN`` where the Hopper kernels take q."""
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and MIN_HEAD_DIM <= q.shape[-1] <= MAX_HEAD_DIM):
        return False
    n = q.shape[-2]
    return n <= AUTO_MAX_SEQ_LEN or (n >= AUTO_HOPPER_MIN_SEQ_LEN and _hopper_takes(q))


def _hopper_takes(q: torch.Tensor) -> bool:
    """``hopper_applies`` to these (B, H, N, d) queries as torch.compile traces the model, at the backward's head
    dims (at 64 the portable forward beside it is as fast as cuDNN's), less TMA's alignment, which only real addresses
    settle (the call checks it, and runs the portable kernels where it fails)."""
    return hopper_applies((q,), lambda: True, BACKWARD_HEAD_DIMS)


@register_attention(
    "flash_triton",
    when_compiled=_faster_when_compiled,
    takes=(
        f"fp16 / bf16 CUDA queries of at most {AUTO_MAX_SEQ_LEN} positions, or of {AUTO_HOPPER_MIN_SEQ_LEN} or more "
        "where its Hopper kernels take them"
    ),
    device_problem=_device_problem,
)
def flash_triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """FlashAttention-2 in Triton (fp16 / bf16 / fp32, head dims 16..128)."""
    return FlashAttention2Triton.apply(q, k, v, is_causal)
