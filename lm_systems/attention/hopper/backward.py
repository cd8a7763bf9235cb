"""The Hopper (sm_90) backward of FlashAttention at head dims 64 and 128 in Gluon: FlashAttention-3's one pass, by rows.

A program owns 128 keys of one (batch, head) in two consumer warpgroups of 64 (``gluon_common``) and walks the query
tiles that see them, ``BLOCK_M`` query rows a tile (64 at d 128, 128 at d 64: ``ptx.BACKWARD_ROWS``): S = Q Kᵀ and
dP = dO Vᵀ are (BLOCK_M queries × its 64 keys), so a thread holds its rows' logsumexp and D (read from the ring slot
while the products run); P and dS go to shared memory, where the dV and dK products read them transposed (Pᵀ dO,
dSᵀ Q: 64 × d × BLOCK_M). dQ is no program's own: dQᵀ = Kᵀ dSᵀ over the tile's 128 keys (each warpgroup half its rows
at d 128; at d 64, where a wgmma's 64 rows are all of them, its columns of half the queries) goes through one of two
shared-memory buffers to a one-warp reduce partition, which adds it into an fp32 accumulator (B·H, d, N_q) by
Hopper's asynchronous TMA reduction (``cp.reduce.async.bulk.tensor.add``: ``compat.gluon.tma_reduce_add``), waits
until the TMA unit has read the buffer and hands it back (its ``dq_empty`` mbarrier); a producer warp copies each
query tile's Q and dO and its rows' logsumexp (in log2 units) and D into a ring slot. The accumulator is zeroed
before and converted (scaled, transposed, cast: ``dq_conversion``) after.

Shared memory at d 128: K and V 64 KiB, two ring slots of Q and dO 64 (and their rows' statistics 1), P of each
warpgroup 16, one dS tile 16, two dQᵀ buffers 64: 225 KiB of the 227; at d 64 with 128 rows a tile: K and V 32, the
ring 64 (and 2), P 32, dS 32, dQᵀ 64: 226 KiB. So dS has one buffer: a warpgroup writes its half of the next tile's
dS once both have finished the dQᵀ product that read this one (``ds_empty``, two arrivals). Causal tiles are walked in
two loops, the diagonal ones under the mask first; rows past N_q and keys past N_k are zeros (TMA fill), which leaves
those rows P = 1 but dS = 0 and their dO zero: they add nothing.

Registers: Triton 3.6's code generation spills 800 bytes a thread and more here; Triton 3.9's far less, and it is
that code (its PTX, ``ptx``) that runs where the installed Triton is older (docs/attention.md).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from lm_systems.attention.hopper.gluon_common import (
    CONSUMER_REGISTERS,
    FIRST_WARPGROUP,
    LOG2_E,
    SECOND_WARPGROUP,
    WARPGROUP_ROWS,
    WORKER_REGISTERS,
    barriers,
    head_base,
    load_block_pair,
    mma_layout,
    ring_barriers,
    rows_descriptor,
    smem_layout,
    store_tile,
)
from lm_systems.attention.hopper.partition_exit import exit_partitions_of
from lm_systems.compat.gluon import cta_barrier, tma_load, tma_reduce_add

DQ_BUFFERS = gl.constexpr(2)  # dQᵀ tiles between the consumers and the reduce warp
# A ring slot's row statistics (the logsumexp in log2 units, D): BLOCK_M fp32 each, copied by TMA, unswizzled
STATS_LAYOUT = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1))


@gluon.jit
def _tiles_by_rows(
    WARPGROUP: gl.constexpr, dk, dv, k_smem, v_smem, q_ring, do_ring, lse_ring, delta_ring, p_smem, ds_smem, dq_smem,
    ready, empty, ds_full, ds_empty, dq_full, dq_empty, first, lo, hi, key_start, shift, qk_scale,
    BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, MASKED: gl.constexpr,
):  # fmt: skip
    """One warpgroup's walk of query tiles [lo, hi) of the ring (its tile 0 is query tile ``first``): dK and dV of its
    64 keys, and its half of each tile's dQᵀ rows."""
    first_key: gl.constexpr = WARPGROUP * WARPGROUP_ROWS
    s_layout: gl.constexpr = mma_layout(gl.num_warps(), WARPGROUP_ROWS)
    dtype: gl.constexpr = k_smem.dtype
    own_k_t = k_smem.slice(first_key, WARPGROUP_ROWS).permute((1, 0))  # (d, its 64 keys)
    own_v_t = v_smem.slice(first_key, WARPGROUP_ROWS).permute((1, 0))
    own_ds = ds_smem.slice(first_key, WARPGROUP_ROWS, dim=1)  # (the tile's queries, its 64 keys)
    # Its part of dQᵀ = Kᵀ dSᵀ over the 128 keys: at d 128 half the rows (head dimensions) of every query, at d 64
    # (a wgmma is 64 rows at least) every row of half the queries
    if HEAD_DIM == 2 * WARPGROUP_ROWS:
        dq_rows: gl.constexpr = HEAD_DIM // 2
        dq_cols: gl.constexpr = BLOCK_M
        k_t_part = k_smem.slice(WARPGROUP * dq_rows, dq_rows, dim=1).permute((1, 0))  # (d/2, 128 keys)
        ds_t_part = ds_smem.permute((1, 0))  # (128 keys, the tile's queries)
    else:
        dq_rows: gl.constexpr = HEAD_DIM
        dq_cols: gl.constexpr = BLOCK_M // 2
        k_t_part = k_smem.permute((1, 0))  # (d, 128 keys)
        ds_t_part = ds_smem.slice(WARPGROUP * dq_cols, dq_cols).permute((1, 0))  # (128 keys, half the queries)
    zeros = gl.zeros([BLOCK_M, WARPGROUP_ROWS], gl.float32, s_layout)
    dq_zeros = gl.zeros([dq_rows, dq_cols], gl.float32, mma_layout(gl.num_warps(), dq_cols))
    for start_m in range(lo, hi, BLOCK_M):
        i = (start_m - first) // BLOCK_M
        slot = i % STAGES
        rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        q_tile = q_ring.index(slot)
        do_tile = do_ring.index(slot)
        s = warpgroup_mma(q_tile, own_k_t, zeros, use_acc=False, is_async=True)
        dp = warpgroup_mma(do_tile, own_v_t, zeros, use_acc=False, is_async=True)
        # The rows' logsumexp (in log2 units) and D, copied into the slot with Q and dO, read while the products run.
        # Rows past n_q read zeros: their Q and dO rows are zeros too, so S = 0, P = 1, dP = 0 and dS = 0.
        lse2 = lse_ring.index(slot).load(gl.SliceLayout(1, s_layout))
        delta = delta_ring.index(slot).load(gl.SliceLayout(1, s_layout))
        s, dk, dv = warpgroup_mma_wait(1, deps=(s, dk, dv))
        # The previous tile's dV and dK are done: its Q and dO slot goes back (two arrivals), and P may be written.
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), count=1, pred=i > 0)
        p = gl.exp2(s * qk_scale - lse2[:, None])
        if MASKED:  # causal: query i sees key j iff j <= i + shift
            cols = gl.arange(0, WARPGROUP_ROWS, layout=gl.SliceLayout(0, s_layout))  # its keys less key_start
            p = gl.where(cols[None, :] <= rows[:, None] + (shift - key_start), p, 0.0)
        p_smem.store(p.to(dtype))
        fence_async_shared()
        cta_barrier()  # every warp's rows stored before the warpgroup's product reads them
        # -- dV += Pᵀ dO, in flight while dS is formed
        dv = warpgroup_mma(p_smem.permute((1, 0)), do_tile, dv, is_async=True)
        dp = warpgroup_mma_wait(1, deps=(dp,))
        ds = (p * (dp - delta[:, None])).to(dtype)  # the softmax scale is applied once, at the end
        mbarrier.wait(ds_empty, (i & 1) ^ 1)  # both warpgroups' dQᵀ of the previous tile have read the dS tile
        own_ds.store(ds)
        fence_async_shared()
        cta_barrier()
        mbarrier.arrive(ds_full, count=1)
        mbarrier.wait(ds_full, i & 1)
        # -- half of dQᵀ = Kᵀ dSᵀ over the program's 128 keys, to the reduce warp while dK += dSᵀ Q is in flight
        dq_t = warpgroup_mma(k_t_part, ds_t_part, dq_zeros, use_acc=False, is_async=True)
        dk = warpgroup_mma(own_ds.permute((1, 0)), q_tile, dk, is_async=True)
        dq_t = warpgroup_mma_wait(1, deps=(dq_t,))
        mbarrier.arrive(ds_empty, count=1)
        buffer = i % DQ_BUFFERS
        mbarrier.wait(dq_empty.index(buffer), ((i // DQ_BUFFERS) & 1) ^ 1)
        if HEAD_DIM == 2 * WARPGROUP_ROWS:
            dq_smem.index(buffer).slice(WARPGROUP * dq_rows, dq_rows).store(dq_t)
        else:
            dq_smem.index(buffer).slice(WARPGROUP * dq_cols, dq_cols, dim=1).store(dq_t)
        fence_async_shared()
        cta_barrier()
        mbarrier.arrive(dq_full.index(buffer), count=1)
    return dk, dv


@gluon.jit
def _consumer_by_rows(
    WARPGROUP: gl.constexpr, k_smem, v_smem, q_ring, do_ring, lse_ring, delta_ring, p_smem, ds_smem, dq_smem, ready,
    empty, ds_full, ds_empty, dq_full, dq_empty, done, dk_desc, dv_desc, start_n, diag_start, unmasked_start,
    ceil_end, shift, sm_scale, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """One consumer warpgroup: its keys' dK and dV, stored through its half of K and V's shared memory once both
    warpgroups are done reading K."""
    first_key: gl.constexpr = WARPGROUP * WARPGROUP_ROWS
    acc_layout: gl.constexpr = mma_layout(gl.num_warps(), HEAD_DIM)
    key_start = start_n + first_key
    qk_scale = sm_scale * LOG2_E
    own_p = p_smem.index(WARPGROUP)
    dk = warpgroup_mma_init(gl.zeros([WARPGROUP_ROWS, HEAD_DIM], gl.float32, acc_layout))
    dv = warpgroup_mma_init(gl.zeros([WARPGROUP_ROWS, HEAD_DIM], gl.float32, acc_layout))
    # Two loops, the first masked (causal: the diagonal tiles; not causal: the first half, under a mask that keeps
    # every key): walked in one loop, ptxas serialised the products (C7515).
    dk, dv = _tiles_by_rows(
        WARPGROUP, dk, dv, k_smem, v_smem, q_ring, do_ring, lse_ring, delta_ring, own_p, ds_smem, dq_smem, ready, empty,
        ds_full, ds_empty, dq_full, dq_empty, diag_start, diag_start, unmasked_start, key_start, shift, qk_scale,
        BLOCK_M, HEAD_DIM, STAGES, True,
    )  # fmt: skip
    dk, dv = _tiles_by_rows(
        WARPGROUP, dk, dv, k_smem, v_smem, q_ring, do_ring, lse_ring, delta_ring, own_p, ds_smem, dq_smem, ready, empty,
        ds_full, ds_empty, dq_full, dq_empty, diag_start, unmasked_start, ceil_end, key_start, shift, qk_scale,
        BLOCK_M, HEAD_DIM, STAGES, False,
    )  # fmt: skip
    dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
    mbarrier.arrive(done, count=1)
    mbarrier.wait(done, 0)
    store_tile(dk * sm_scale, k_smem.slice(first_key, WARPGROUP_ROWS), dk_desc, start_n + first_key)
    store_tile(dv, v_smem.slice(first_key, WARPGROUP_ROWS), dv_desc, start_n + first_key)


@gluon.jit
def stats_descriptor(X, n_q, BLOCK_M: gl.constexpr):
    """A TMA descriptor over one head's n_q row statistics (fp32), BLOCK_M a copy, zeros past n_q."""
    return tma.make_tensor_descriptor(X, shape=[n_q], strides=[1], block_shape=[BLOCK_M], layout=STATS_LAYOUT)


@gluon.jit
def _load_tiles(
    q_desc, do_desc, lse_desc, delta_desc, q_ring, do_ring, lse_ring, delta_ring, ready, empty, first, count,
    BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """The producer partition: each query tile's Q, dO and row statistics into its ring slot, once both consumers
    have released it."""
    nbytes: gl.constexpr = q_desc.block_type.nbytes + do_desc.block_type.nbytes + 2 * lse_desc.block_type.nbytes
    for i in range(count):
        slot = i % STAGES
        # A fresh barrier counts as released in the phase before its first: the first lap does not wait.
        mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(slot), nbytes)
        start = first + i * BLOCK_M
        tma_load(q_desc, [start, 0], ready.index(slot), q_ring.index(slot))
        tma_load(do_desc, [start, 0], ready.index(slot), do_ring.index(slot))
        tma_load(lse_desc, [start], ready.index(slot), lse_ring.index(slot))
        tma_load(delta_desc, [start], ready.index(slot), delta_ring.index(slot))


@gluon.jit
def _reduce_dq(dq_desc, dq_smem, dq_full, dq_empty, first, count, BLOCK_M: gl.constexpr):
    """The reduce partition: add each handed-over dQᵀ tile into the accumulator's columns of its query rows."""
    for i in range(count):
        buffer = i % DQ_BUFFERS
        mbarrier.wait(dq_full.index(buffer), (i // DQ_BUFFERS) & 1)
        tma_reduce_add(dq_desc, [0, first + i * BLOCK_M], dq_smem.index(buffer))
        tma.store_wait(pendings=0)  # the TMA unit has read the buffer
        mbarrier.arrive(dq_empty.index(buffer), count=1)


@gluon.jit(do_not_specialize=["num_heads", "n_q", "n_k", "stride_dqn", "stride_stats"])
def gluon_backward_kernel(
    Q, K, V, DO, STATS, DK, DV, DQ_ACC,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    stride_dqn, stride_stats, num_heads, n_q, n_k, sm_scale,
    HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """One program (launched with num_warps=4): 128 keys of one (batch, head), grid (key tiles of 128, B·H), so that
    a head's programs run side by side and share its Q and dO in L2; ``BLOCK_M`` 64 or 128. DQ_ACC is the zeroed
    (B·H, HEAD_DIM, N_q rounded up to 4) fp32 accumulator, its rows ``stride_dqn`` apart."""
    BLOCK_N: gl.constexpr = 2 * WARPGROUP_ROWS
    bh = gl.program_id(1)
    start_n = gl.program_id(0) * BLOCK_N
    q_desc = rows_descriptor(head_base(Q, bh, num_heads, stride_qb, stride_qh), n_q, stride_qn, HEAD_DIM, BLOCK_M)
    do_desc = rows_descriptor(head_base(DO, bh, num_heads, stride_dob, stride_doh), n_q, stride_don, HEAD_DIM, BLOCK_M)
    k_desc = rows_descriptor(head_base(K, bh, num_heads, stride_kb, stride_kh), n_k, stride_kn, HEAD_DIM, BLOCK_N)
    v_desc = rows_descriptor(head_base(V, bh, num_heads, stride_vb, stride_vh), n_k, stride_vn, HEAD_DIM, BLOCK_N)
    dk_desc = rows_descriptor(
        head_base(DK, bh, num_heads, stride_dkb, stride_dkh), n_k, stride_dkn, HEAD_DIM, WARPGROUP_ROWS
    )
    dv_desc = rows_descriptor(
        head_base(DV, bh, num_heads, stride_dvb, stride_dvh), n_k, stride_dvn, HEAD_DIM, WARPGROUP_ROWS
    )
    dq_layout: gl.constexpr = smem_layout(32)
    dq_desc = tma.make_tensor_descriptor(
        DQ_ACC + bh.to(gl.int64) * HEAD_DIM * stride_dqn,
        shape=[HEAD_DIM, n_q],
        strides=[stride_dqn, 1],
        block_shape=[HEAD_DIM, BLOCK_M],
        layout=dq_layout,
    )
    # STATS is (B·H, 2, N_q rounded up to 4): each head's logsumexp in log2 units, then its D
    lse_desc = stats_descriptor(STATS + bh.to(gl.int64) * 2 * stride_stats, n_q, BLOCK_M)
    delta_desc = stats_descriptor(STATS + (bh.to(gl.int64) * 2 + 1) * stride_stats, n_q, BLOCK_M)

    k_smem = gl.allocate_shared_memory(k_desc.dtype, [BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [BLOCK_N, HEAD_DIM], v_desc.layout)
    q_ring = gl.allocate_shared_memory(q_desc.dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_ring = gl.allocate_shared_memory(do_desc.dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
    lse_ring = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], STATS_LAYOUT)
    delta_ring = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], STATS_LAYOUT)
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, WARPGROUP_ROWS], k_desc.dtype)
    p_smem = gl.allocate_shared_memory(k_desc.dtype, [2, BLOCK_M, WARPGROUP_ROWS], p_layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], k_desc.dtype)
    ds_smem = gl.allocate_shared_memory(k_desc.dtype, [BLOCK_M, BLOCK_N], ds_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [DQ_BUFFERS, HEAD_DIM, BLOCK_M], dq_layout)
    ready, empty = ring_barriers(STAGES, 2)
    ds_full = barriers(1, 2).index(0)
    ds_empty = barriers(1, 2).index(0)
    dq_full = barriers(DQ_BUFFERS, 2)
    dq_empty = barriers(DQ_BUFFERS, 1)
    done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(done, count=2)
    load_block_pair(k_desc, v_desc, start_n, k_smem, v_smem)

    ceil_end = (n_q + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    shift = n_k - n_q
    if CAUSAL:  # query tiles crossing the program's 128 keys' diagonal (masked), then those below it
        diag_start = gl.maximum(start_n - shift, 0) // BLOCK_M * BLOCK_M
        unmasked_start = gl.minimum(
            (gl.maximum(start_n + BLOCK_N - shift, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M, ceil_end
        )
    else:
        diag_start = 0
        unmasked_start = ceil_end // (2 * BLOCK_M) * BLOCK_M  # the two loops of _consumer_by_rows
        shift = start_n + BLOCK_N  # past the program's keys: the first loop's mask keeps every key
    sm_scale = sm_scale.to(gl.float32)
    count = (ceil_end - diag_start) // BLOCK_M
    gl.warp_specialize(
        [
            (_consumer_by_rows, (FIRST_WARPGROUP, k_smem, v_smem, q_ring, do_ring, lse_ring, delta_ring, p_smem,
                                 ds_smem, dq_smem, ready, empty, ds_full, ds_empty, dq_full, dq_empty, done, dk_desc,
                                 dv_desc, start_n, diag_start, unmasked_start, ceil_end, shift, sm_scale, BLOCK_M,
                                 HEAD_DIM, STAGES)),
            (_consumer_by_rows, (SECOND_WARPGROUP, k_smem, v_smem, q_ring, do_ring, lse_ring, delta_ring, p_smem,
                                 ds_smem, dq_smem, ready, empty, ds_full, ds_empty, dq_full, dq_empty, done, dk_desc,
                                 dv_desc, start_n, diag_start, unmasked_start, ceil_end, shift, sm_scale, BLOCK_M,
                                 HEAD_DIM, STAGES)),
            (_load_tiles, (q_desc, do_desc, lse_desc, delta_desc, q_ring, do_ring, lse_ring, delta_ring, ready,
                           empty, diag_start, count, BLOCK_M, STAGES)),
            (_reduce_dq, (dq_desc, dq_smem, dq_full, dq_empty, diag_start, count, BLOCK_M)),
        ],
        [4, 1, 1],
        [CONSUMER_REGISTERS, WORKER_REGISTERS, WORKER_REGISTERS],
    )  # fmt: skip


# One warp_specialize, entered once: the workers may leave when their partition is done.
exit_partitions_of("gluon_backward_kernel")
