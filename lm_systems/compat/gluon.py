"""Gluon's internals, each behind one public name (tests: tests/compat/test_gluon.py). Imports no Lightning or torch.

Triton 3.6's Gluon builds Hopper's asynchronous TMA reduction (``cp.reduce.async.bulk.tensor``: a shared-memory tile
added element-wise into a global tile, done by the TMA unit) in its IR builder, ``create_async_tma_reduce``, but its
``tma`` module has no function that emits it. ``tma_reduce_add`` is that function, written as Gluon's own ``tma``
functions are; its completion is waited for as a TMA store's is (``tma.store_wait``).
"""

from __future__ import annotations

import triton
from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import tma

# Renamed in Triton 3.9 (whose code generation fits FlashAttention-3's d 128 backward in a consumer's registers,
# docs/attention.md); the old names raise there. The kernels call these, so one source compiles with 3.6 and 3.9.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """Add the shared-memory tile ``src`` into the global tile of ``tensor_desc`` at ``coord``, asynchronously (the
    descriptor's bounds clip what lies outside the tensor)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


# Triton 3.9 has the reduction as a public function.
tma_reduce_add = getattr(tma, "async_atomic_add", None) or _tma_reduce_add


def sm90_ptx(kernel, signature: dict, constexprs: dict, attrs: dict, num_warps: int) -> str:
    """The PTX Triton compiles a Gluon kernel to for sm_90 (Hopper), without a GPU: ``signature`` maps each argument
    to its type (``*bf16``, ``i32``, ``constexpr``, ...), ``attrs`` argument positions to their specialisations
    (``{(i,): [["tt.divisibility", 16]]}``)."""
    source = GluonASTSource(kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps, "enable_fp_fusion": True}  # as Triton's launches have it by default
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
