"""What the Hopper (sm_90) attention kernels in Gluon share: layouts, TMA descriptors, rings, barriers, registers.

The kernels (``forward``, ``backward``) are laid out as FlashAttention-3 lays out its own: a program's rows split
between two consumer warpgroups of 64, each its own partition of ``gl.warp_specialize`` (the first the default
partition, the second a worker), and a one-warp producer partition that copies the walked tiles by TMA into a ring
of shared-memory slots, a ``ready`` mbarrier per slot saying its bytes have landed and an ``empty`` one saying both
warpgroups are done with it.

Registers: a kernel is 12 warps (two consumer warpgroups and the producer's warpgroup, of which three warps idle),
so every thread starts at 168; a worker warpgroup at ``CONSUMER_REGISTERS`` and the producer's at
``WORKER_REGISTERS`` leave the default partition 168 + (168 - 240) + (168 - 24) = 240 as well (Triton gives it what
is left): the 64K registers of an SM, spent. For ptxas to allocate the worker consumer at that count, its PTX must not
branch back into Triton's dispatcher loop (``partition_exit``).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from lm_systems.compat.gluon import tma_load, tma_store

LOG2_E = gl.constexpr(1.4426950408889634)  # 1 / ln 2: exp(x) = exp2(x · log2 e)
WARPGROUP_ROWS = gl.constexpr(64)  # a consumer warpgroup's rows of the program's own tile (16 a warp)
CONSUMER_REGISTERS = gl.constexpr(240)
WORKER_REGISTERS = gl.constexpr(24)  # the producer (and reduce) warps only compute addresses and wait
FIRST_WARPGROUP = gl.constexpr(0)  # the default partition
SECOND_WARPGROUP = gl.constexpr(1)  # a worker partition


@gluon.constexpr_function
def mma_layout(num_warps, n):
    """The wgmma accumulator layout of a (rows, n) tile: warps stacked along the rows, one instruction n wide."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16])


@gluon.constexpr_function
def smem_layout(element_bitwidth):
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=element_bitwidth, rank=2)


@gluon.jit
def head_base(X, bh, num_heads, stride_b, stride_h):
    return X + (bh // num_heads).to(gl.int64) * stride_b + (bh % num_heads).to(gl.int64) * stride_h


@gluon.jit
def rows_descriptor(X, n_rows, stride_n, HEAD_DIM: gl.constexpr, BLOCK: gl.constexpr):
    """A TMA descriptor over one head's (n_rows, HEAD_DIM) rows, BLOCK rows a copy, zeros past n_rows."""
    return tma.make_tensor_descriptor(
        X,
        shape=[n_rows, HEAD_DIM],
        strides=[stride_n, 1],
        block_shape=[BLOCK, HEAD_DIM],
        layout=smem_layout(X.dtype.element_ty.primitive_bitwidth),
    )


@gluon.jit
def load_block_pair(a_desc, b_desc, start, a_smem, b_smem):
    """The two tiles a program holds throughout, copied once, waited for here."""
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma_load(a_desc, [start, 0], bar, a_smem)
    tma_load(b_desc, [start, 0], bar, b_smem)
    mbarrier.wait(bar, 0)
    mbarrier.invalidate(bar)


@gluon.jit
def ring_barriers(STAGES: gl.constexpr, CONSUMERS: gl.constexpr = 1):
    """Per ring slot: ``ready`` (the producer's copies landed) and ``empty`` (each of the ``CONSUMERS`` consumer
    partitions is done with it: one arrival each)."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for slot in gl.static_range(STAGES):
        mbarrier.init(ready.index(slot), count=1)
        mbarrier.init(empty.index(slot), count=CONSUMERS)
    return ready, empty


@gluon.jit
def store_tile(x, smem, desc, start):
    """x (fp32 registers) → the output's dtype → shared memory → TMA store (rows past the end are dropped)."""
    smem.store(x.to(desc.dtype))
    fence_async_shared()
    tma_store(desc, [start, 0], smem)
    tma.store_wait(pendings=0)


@gluon.jit
def barriers(n: gl.constexpr, count: gl.constexpr):
    """``n`` mbarriers, each completing after ``count`` arrivals."""
    bars = gl.allocate_shared_memory(gl.int64, [n, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(n):
        mbarrier.init(bars.index(i), count=count)
    return bars
