"""The Hopper (sm_90) forward of FlashAttention in Gluon, laid out as FlashAttention-3 lays it out.

A program owns 128 query rows of one (batch, head), split between two consumer warpgroups of 64 rows each; each
warpgroup is its own partition of ``gl.warp_specialize`` (the first the default partition, the second a worker), so
that the two drift out of phase and one's exponentials run while the other's products are in the tensor cores. A
one-warp producer partition copies the key and value tiles by TMA into two rings of ``STAGES`` shared-memory slots,
keys and values each with their own mbarriers: ``ready`` (the copy landed) and ``empty`` (both warpgroups are done
with it: two arrivals). A key slot goes back as soon as S has been computed from it, a value slot once P·V has: so
the next key tile is copied while this tile's P·V and softmax run.

Within a warpgroup the tiles are software-pipelined (FlashAttention-3's intra-warpgroup pipelining): S = Q·Kᵀ of
tile j is issued first, then O += P·V of tile j - 1 behind it; the softmax of tile j runs as soon as S has landed,
while P·V is still in the tensor cores; only then is O waited for and rescaled by the new running maximum.

Everything else is the portable forward's (``flash_triton_forward``): softmax in base 2 on scores scaled by
``sm_scale · log2 e``, L stored as the natural-log logsumexp indexed (B·H, N_q), O in the inputs' dtype, a row that
sees no key (causal, N_q > N_k) O = 0 and L = -inf. Causal tiles are walked in two stages, the ones every row of the
program sees in full without a mask, then the diagonal and the ragged end of the keys with one (TMA reads zeros
past N_k, whose scores are not -inf: they are masked too); the program's first tile is always masked (it starts the
pipeline, wherever the diagonal is). A head's query tiles are launched side by side (the grid's first axis), so
that they read its keys and values from L2, and longest first (the last query tiles, under a causal mask).

Compiled with ``partition_exit``'s rewrite, without which ptxas serialises the worker warpgroup's wgmma.
Only ``dispatch`` imports this, on the first Hopper call (Gluon has no CPU interpreter).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from lm_systems.attention.hopper.gluon_common import (
    CONSUMER_REGISTERS,
    FIRST_WARPGROUP,
    LOG2_E,
    SECOND_WARPGROUP,
    WARPGROUP_ROWS,
    WORKER_REGISTERS,
    head_base,
    mma_layout,
    rows_descriptor,
    store_tile,
)
from lm_systems.attention.hopper.partition_exit import exit_partitions_of
from lm_systems.compat.gluon import tma_load

LN_2 = gl.constexpr(0.6931471805599453)


@gluon.jit
def _load_keys_values(k_desc, v_desc, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty, count,
                      BLOCK_N: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """The producer partition: key tiles 0 .. count - 1 and their value tiles into the rings, each slot once both
    consumers have released it (a fresh barrier counts as released in the phase before its first)."""
    for i in range(count):
        slot = i % STAGES
        released = ((i // STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(slot), released)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma_load(k_desc, [i * BLOCK_N, 0], k_ready.index(slot), k_ring.index(slot))
        mbarrier.wait(v_empty.index(slot), released)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma_load(v_desc, [i * BLOCK_N, 0], v_ready.index(slot), v_ring.index(slot))


@gluon.jit
def _scores(q_smem, k_ring, k_ready, i, zeros, STAGES: gl.constexpr):
    """Issue S = Q·Kᵀ of ring tile ``i`` (asynchronous), once its keys have landed."""
    slot = i % STAGES
    mbarrier.wait(k_ready.index(slot), (i // STAGES) & 1)
    return warpgroup_mma(q_smem, k_ring.index(slot).permute((1, 0)), zeros, use_acc=False, is_async=True)


@gluon.jit
def _softmax_step(s, m_i, l_i, start_n, rows, n_k, shift, qk_scale, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
                  MASKED: gl.constexpr):  # fmt: skip
    """The new running maximum (base 2, scaled), P relative to it, the rescale factor of what was accumulated under
    the old one, and the new running sum."""
    if MASKED:
        cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        visible = cols[None, :] < n_k
        if CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None] + shift)
        s = gl.where(visible, s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key: avoid -inf - -inf
        p = gl.exp2(s - m_ref[:, None])
    else:
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        m_ref = m_new
        p = gl.exp2(s * qk_scale - m_ref[:, None])
    alpha = gl.exp2(m_i - m_ref)
    return p, m_new, l_i * alpha + gl.sum(p, 1), alpha


@gluon.jit
def _attend_tiles(o, m_i, l_i, p_prev, q_smem, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty, lo, hi, rows,
                  n_k, shift, qk_scale, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                  MASKED: gl.constexpr):  # fmt: skip
    """Key tiles [lo, hi), each tile's S issued before the previous tile's P·V, whose P (``p_prev``, an operand in
    registers) arrives from the previous step and the new one leaves for the next."""
    zeros = gl.zeros([WARPGROUP_ROWS, BLOCK_N], gl.float32, mma_layout(gl.num_warps(), BLOCK_N))
    for start_n in range(lo, hi, BLOCK_N):
        i = start_n // BLOCK_N
        s = _scores(q_smem, k_ring, k_ready, i, zeros, STAGES)
        prev = (i - 1) % STAGES
        mbarrier.wait(v_ready.index(prev), ((i - 1) // STAGES) & 1)
        o = warpgroup_mma(p_prev, v_ring.index(prev), o, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s,))  # S has landed; P·V may still be in flight
        mbarrier.arrive(k_empty.index(i % STAGES), count=1)
        p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, start_n, rows, n_k, shift, qk_scale, BLOCK_N, CAUSAL, MASKED)
        o, p_prev = warpgroup_mma_wait(0, deps=(o, p_prev))
        mbarrier.arrive(v_empty.index(prev), count=1)
        o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o.type.layout))[:, None]
        p_prev = gl.convert_layout(p.to(q_smem.dtype), p_prev.type.layout)
    return o, m_i, l_i, p_prev


@gluon.jit
def _forward_warpgroup(
    WARPGROUP: gl.constexpr, q_smem, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty, o_desc, LSE, start_m,
    unmasked_end, masked_end, n_q, n_k, shift, sm_scale,
    BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
):  # fmt: skip
    """One consumer warpgroup: O and L of its 64 query rows of the program's 128; O is stored through its half of
    Q's shared memory (which only it reads, and no longer needs)."""
    first_row: gl.constexpr = WARPGROUP * WARPGROUP_ROWS
    own_q = q_smem.slice(first_row, WARPGROUP_ROWS)
    s_layout: gl.constexpr = mma_layout(gl.num_warps(), BLOCK_N)
    o_layout: gl.constexpr = mma_layout(gl.num_warps(), HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    rows = start_m + first_row + gl.arange(0, WARPGROUP_ROWS, layout=gl.SliceLayout(1, s_layout))
    qk_scale = sm_scale * LOG2_E
    m_i = gl.full([WARPGROUP_ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([WARPGROUP_ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    o = gl.zeros([WARPGROUP_ROWS, HEAD_DIM], gl.float32, o_layout)

    # -- the first tile starts the pipeline: its S alone, masked (the diagonal may be there)
    zeros = gl.zeros([WARPGROUP_ROWS, BLOCK_N], gl.float32, s_layout)
    s = warpgroup_mma_wait(0, deps=(_scores(own_q, k_ring, k_ready, 0, zeros, STAGES),))
    mbarrier.arrive(k_empty.index(0), count=1)
    p, m_i, l_i, _ = _softmax_step(s, m_i, l_i, 0, rows, n_k, shift, qk_scale, BLOCK_N, CAUSAL, True)  # O is 0
    p_prev = gl.convert_layout(p.to(q_smem.dtype), p_layout)
    # -- the tiles every row of the program sees in full, then the diagonal and the ragged end
    o, m_i, l_i, p_prev = _attend_tiles(
        o, m_i, l_i, p_prev, own_q, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty, BLOCK_N, unmasked_end, rows,
        n_k, shift, qk_scale, BLOCK_N, STAGES, CAUSAL, False,
    )  # fmt: skip
    o, m_i, l_i, p_prev = _attend_tiles(
        o, m_i, l_i, p_prev, own_q, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty,
        gl.maximum(unmasked_end, BLOCK_N), masked_end, rows, n_k, shift, qk_scale, BLOCK_N, STAGES, CAUSAL, True,
    )  # fmt: skip
    # -- the last tile's P·V
    last = gl.maximum(masked_end, BLOCK_N) // BLOCK_N - 1
    mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
    o = warpgroup_mma(p_prev, v_ring.index(last % STAGES), o, is_async=True)
    o, p_prev = warpgroup_mma_wait(0, deps=(o, p_prev))

    # -- rows that saw no key get O = 0 and L = -inf
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    lse = gl.where(l_i == 0.0, float("-inf"), (m_i + gl.log2(l_safe)) * LN_2)
    gl.store(LSE + rows, lse, mask=rows < n_q)
    l_o = gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))
    store_tile(o / l_o[:, None], own_q, o_desc, start_m + first_row)


@gluon.jit(do_not_specialize=["num_heads", "n_q", "n_k"])
def gluon_forward_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    num_heads, n_q, n_k, sm_scale,
    HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """One program (launched with num_warps=4): 128 queries of one (batch, head); grid (query tiles of 128, B·H),
    so that a head's programs run side by side and share its keys and values in L2, the last query tiles (the
    longest under a causal mask) first."""
    BLOCK_M: gl.constexpr = 2 * WARPGROUP_ROWS
    bh = gl.program_id(1)
    start_m = (gl.num_programs(0) - 1 - gl.program_id(0)) * BLOCK_M
    q_desc = rows_descriptor(head_base(Q, bh, num_heads, stride_qb, stride_qh), n_q, stride_qn, HEAD_DIM, BLOCK_M)
    k_desc = rows_descriptor(head_base(K, bh, num_heads, stride_kb, stride_kh), n_k, stride_kn, HEAD_DIM, BLOCK_N)
    v_desc = rows_descriptor(head_base(V, bh, num_heads, stride_vb, stride_vh), n_k, stride_vn, HEAD_DIM, BLOCK_N)
    o_desc = rows_descriptor(
        head_base(O, bh, num_heads, stride_ob, stride_oh), n_q, stride_on, HEAD_DIM, WARPGROUP_ROWS
    )
    LSE += bh.to(gl.int64) * n_q

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    k_ring = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_ring = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for slot in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(slot), count=1)
        mbarrier.init(v_ready.index(slot), count=1)
        mbarrier.init(k_empty.index(slot), count=2)  # one release from each consumer warpgroup
        mbarrier.init(v_empty.index(slot), count=2)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    mbarrier.expect(q_ready, q_desc.block_type.nbytes)
    tma_load(q_desc, [start_m, 0], q_ready, q_smem)

    shift = n_k - n_q  # causal: query i sees key j iff j <= i + shift
    masked_end = (n_k + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    if CAUSAL:  # key tiles every row of the program sees in full, then up to the last row's last key
        unmasked_end = gl.maximum(gl.minimum(start_m + shift + 1, n_k), 0) // BLOCK_N * BLOCK_N
        masked_end = gl.minimum(
            (gl.maximum(start_m + BLOCK_M + shift, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N, masked_end
        )
        masked_end = gl.maximum(masked_end, unmasked_end)
    else:
        unmasked_end = n_k // BLOCK_N * BLOCK_N
    count = gl.maximum(masked_end // BLOCK_N, 1)  # the first tile is always walked (masked)
    sm_scale = sm_scale.to(gl.float32)
    mbarrier.wait(q_ready, 0)
    mbarrier.invalidate(q_ready)
    gl.warp_specialize(
        [
            (_forward_warpgroup, (FIRST_WARPGROUP, q_smem, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty, o_desc,
                                  LSE, start_m, unmasked_end, masked_end, n_q, n_k, shift, sm_scale, BLOCK_N,
                                  HEAD_DIM, STAGES, CAUSAL)),
            (_forward_warpgroup, (SECOND_WARPGROUP, q_smem, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty, o_desc,
                                  LSE, start_m, unmasked_end, masked_end, n_q, n_k, shift, sm_scale, BLOCK_N,
                                  HEAD_DIM, STAGES, CAUSAL)),
            (_load_keys_values, (k_desc, v_desc, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty, count, BLOCK_N,
                                  STAGES)),
        ],
        [4, 1],
        [CONSUMER_REGISTERS, WORKER_REGISTERS],
    )  # fmt: skip


# One warp_specialize, entered once: the workers may leave when their partition is done.
exit_partitions_of("gluon_forward_kernel")
