"""Triton backward kernels of FlashAttention-2: D = rowsum(dO ∘ O), a dK/dV pass and a dQ pass.

The two passes recompute P = exp2(S · scale · log2 e − L · log2 e) from the saved logsumexp instead
of storing it, and split the work so that every output tile has one owner: a dK/dV program holds a
key tile and walks the query tiles that see it, a dQ program holds a query tile and walks the key
tiles it sees. No atomics, no second accumulation buffer. As in the forward, causal tiles are
visited in stages so that only tiles crossing the diagonal (or the ragged end) are masked.

With ``TMA`` the passes load their q, k, v, dO tiles through tensor descriptors (on Hopper, the TMA unit
copies a whole tile to shared memory, zero past the sequence's end) instead of a pointer per element. The
caller sets it only where descriptors can address the tensors: a power-of-two head dim (no padding) and
16-byte aligned rows (``flash_triton.tma_loads``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from lm_systems.attention.flash_triton_forward import (
    FP32_DOT_PRECISION,
    LOG2_E,
    _head_offset,
    _key_ranges,
    _load_rows,
    _program_tile,
    _store_rows,
)


@triton.jit
def _tile_source(X, n_rows, stride_n, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, TMA: tl.constexpr):
    """Where a (BLOCK, HEAD_DIM) tile of X's rows is loaded from: a tensor descriptor, or X's pointer itself."""
    if TMA:
        source = tl.make_tensor_descriptor(
            X, shape=[n_rows, HEAD_DIM], strides=[stride_n, 1], block_shape=[BLOCK, HEAD_DIM]
        )
    else:
        source = X
    return source


@triton.jit
def _load_tile(
    source,
    start,
    stride_n,
    n_rows,
    offs_d,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
    MASKED: tl.constexpr,
    TMA: tl.constexpr,
):
    """Rows [start, start + BLOCK) of a ``_tile_source``, zero past ``n_rows`` (if MASKED) and past HEAD_DIM."""
    if TMA:
        tile = source.load([start, 0])
    else:
        rows = start + tl.arange(0, BLOCK)
        tile = _load_rows(
            source + rows[:, None] * stride_n + offs_d[None, :], rows, n_rows, offs_d, HEAD_DIM, HEAD_DIM_PAD, MASKED
        )
    return tile


@triton.jit
def _load_block(
    X,
    start,
    n_rows,
    stride_n,
    offs_d,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
    TMA: tl.constexpr,
):
    """The tile a program holds throughout: X's rows [start, start + BLOCK), zero past ``n_rows`` and HEAD_DIM."""
    source = _tile_source(X, n_rows, stride_n, HEAD_DIM, BLOCK, TMA)
    return _load_tile(source, start, stride_n, n_rows, offs_d, HEAD_DIM, HEAD_DIM_PAD, BLOCK, True, TMA)


@triton.jit(do_not_specialize=["num_heads", "n_q"])
def attn_bwd_preprocess_kernel(
    O,
    DO,
    DELTA,
    stride_ob,
    stride_oh,
    stride_on,
    stride_dob,
    stride_doh,
    stride_don,
    num_heads,
    n_q,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """D = rowsum(dO ∘ O), once per query row, so neither pass recomputes it per tile."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    bh = tl.program_id(1)
    O += _head_offset(bh, num_heads, stride_ob, stride_oh)
    DO += _head_offset(bh, num_heads, stride_dob, stride_doh)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    o = _load_rows(O + offs_m[:, None] * stride_on + offs_d[None, :], offs_m, n_q, offs_d, HEAD_DIM, HEAD_DIM_PAD, True)
    do = _load_rows(
        DO + offs_m[:, None] * stride_don + offs_d[None, :], offs_m, n_q, offs_d, HEAD_DIM, HEAD_DIM_PAD, True
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + bh.to(tl.int64) * n_q + offs_m, delta, mask=offs_m < n_q)


@triton.jit
def _dkdv_inner(
    dk,
    dv,
    k,
    v,
    q_source,
    do_source,
    LSE,
    DELTA,
    stride_qn,
    stride_don,
    offs_n,
    offs_d,
    lo,
    hi,
    n_q,
    n_k,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,
    TMA: tl.constexpr,
):
    offs_m = tl.arange(0, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        rows = start_m + offs_m
        q = _load_tile(q_source, start_m, stride_qn, n_q, offs_d, HEAD_DIM, HEAD_DIM_PAD, BLOCK_M, MASKED, TMA)
        if MASKED:
            lse2 = tl.load(LSE + rows, mask=rows < n_q, other=0.0) * LOG2_E
        else:
            lse2 = tl.load(LSE + rows) * LOG2_E
        # Transposed tiles (keys × queries) so that dV and dK come out of plain dots, no transposes.
        s_t = tl.dot(k, tl.trans(q), input_precision=FP32_DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
        p_t = tl.math.exp2(s_t * qk_scale - lse2[None, :])
        if MASKED:
            visible = rows[None, :] < n_q
            if CAUSAL:
                visible = visible & (offs_n[:, None] <= rows[None, :] + (n_k - n_q))
            # where, not multiply: a row that sees no key has L = -inf and exp2 gave inf there.
            p_t = tl.where(visible, p_t, 0.0)
        do = _load_tile(do_source, start_m, stride_don, n_q, offs_d, HEAD_DIM, HEAD_DIM_PAD, BLOCK_M, MASKED, TMA)
        # -- dV += Pᵀ dO
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=FP32_DOT_PRECISION)
        # -- dSᵀ = Pᵀ ∘ (dPᵀ − D), dK += dSᵀ Q (the softmax scale is applied once, at the end)
        if MASKED:
            delta = tl.load(DELTA + rows, mask=rows < n_q, other=0.0)
        else:
            delta = tl.load(DELTA + rows)
        dp_t = tl.dot(v, tl.trans(do), input_precision=FP32_DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=FP32_DOT_PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=["num_heads", "n_q", "n_k", "N_Q_KEY", "N_K_KEY"])
def attn_bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_dob,
    stride_doh,
    stride_don,
    stride_dkb,
    stride_dkh,
    stride_dkn,
    stride_dvb,
    stride_dvh,
    stride_dvn,
    num_heads,
    n_q,
    n_k,
    sm_scale,
    N_Q_KEY,
    N_K_KEY,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
    TMA: tl.constexpr,
):
    """One program: BLOCK_N keys of one (batch, head); walks every query tile that sees them."""
    tile, _, bh = _program_tile(HEADS_FIRST)
    start_n = tile * BLOCK_N
    Q += _head_offset(bh, num_heads, stride_qb, stride_qh)
    K += _head_offset(bh, num_heads, stride_kb, stride_kh)
    V += _head_offset(bh, num_heads, stride_vb, stride_vh)
    DO += _head_offset(bh, num_heads, stride_dob, stride_doh)
    DK += _head_offset(bh, num_heads, stride_dkb, stride_dkh)
    DV += _head_offset(bh, num_heads, stride_dvb, stride_dvh)
    LSE += bh.to(tl.int64) * n_q
    DELTA += bh.to(tl.int64) * n_q

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    k = _load_block(K, start_n, n_k, stride_kn, offs_d, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, TMA)
    v = _load_block(V, start_n, n_k, stride_vn, offs_d, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, TMA)
    q_source = _tile_source(Q, n_q, stride_qn, HEAD_DIM, BLOCK_M, TMA)
    do_source = _tile_source(DO, n_q, stride_don, HEAD_DIM, BLOCK_M, TMA)
    dk = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    sm_scale = tl.cast(sm_scale, tl.float32)  # Inductor passes a Python float as fp64
    qk_scale = sm_scale * LOG2_E

    full_end = (n_q // BLOCK_M) * BLOCK_M  # query tiles with no ragged end
    ceil_end = tl.cdiv(n_q, BLOCK_M) * BLOCK_M
    if CAUSAL:
        shift = n_k - n_q
        # Query i sees key j iff i >= j - shift: the first query seeing any key of this tile, and
        # the first from which every query sees all of them; start at the diagonal, skip what is above.
        diag_start = tl.maximum(start_n - shift, 0) // BLOCK_M * BLOCK_M
        unmasked_start = tl.cdiv(tl.maximum(start_n + BLOCK_N - shift, 0), BLOCK_M) * BLOCK_M
    else:
        diag_start = 0
        unmasked_start = 0
    for stage in tl.static_range(3):  # unrolled: each stage its own call, masked or not
        if stage == 0:  # query tiles crossing the diagonal, masked
            lo, hi = diag_start, tl.minimum(unmasked_start, ceil_end)
        elif stage == 1:  # query tiles that see the whole key tile, no mask
            lo, hi = unmasked_start, full_end
        else:  # the ragged last query tile, masked (empty when stage 0 already reached it)
            lo, hi = tl.maximum(unmasked_start, full_end), ceil_end
        dk, dv = _dkdv_inner(
            dk,
            dv,
            k,
            v,
            q_source,
            do_source,
            LSE,
            DELTA,
            stride_qn,
            stride_don,
            offs_n,
            offs_d,
            lo,
            hi,
            n_q,
            n_k,
            qk_scale,
            HEAD_DIM,
            HEAD_DIM_PAD,
            BLOCK_M,
            CAUSAL,
            stage != 1,
            TMA,
        )

    _store_rows(DK, dk * sm_scale, offs_n, n_k, stride_dkn, offs_d, HEAD_DIM, HEAD_DIM_PAD)
    _store_rows(DV, dv, offs_n, n_k, stride_dvn, offs_d, HEAD_DIM, HEAD_DIM_PAD)


@triton.jit
def _dq_inner(
    dq,
    q,
    do,
    lse2,
    delta,
    k_source,
    v_source,
    stride_kn,
    stride_vn,
    offs_m,
    offs_d,
    lo,
    hi,
    n_q,
    n_k,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,
    TMA: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k = _load_tile(k_source, start_n, stride_kn, n_k, offs_d, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, MASKED, TMA)
        v = _load_tile(v_source, start_n, stride_vn, n_k, offs_d, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, MASKED, TMA)
        s = tl.dot(q, tl.trans(k), input_precision=FP32_DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        p = tl.math.exp2(s * qk_scale - lse2[:, None])
        if MASKED:
            visible = cols[None, :] < n_k
            if CAUSAL:
                visible = visible & (cols[None, :] <= offs_m[:, None] + (n_k - n_q))
            p = tl.where(visible, p, 0.0)
        # -- dS = P ∘ (dP − D), dQ += dS K
        dp = tl.dot(do, tl.trans(v), input_precision=FP32_DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=FP32_DOT_PRECISION)
    return dq


@triton.jit(do_not_specialize=["num_heads", "n_q", "n_k", "N_Q_KEY", "N_K_KEY"])
def attn_bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_dob,
    stride_doh,
    stride_don,
    stride_dqb,
    stride_dqh,
    stride_dqn,
    num_heads,
    n_q,
    n_k,
    sm_scale,
    N_Q_KEY,
    N_K_KEY,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
    TMA: tl.constexpr,
):
    """One program: BLOCK_M queries of one (batch, head); walks every key tile they see."""
    # Last query tiles first: under a causal mask they have the most keys to visit, and starting the
    # longest programs first leaves short ones, not long ones, for the tail of the launch.
    tile, tiles, bh = _program_tile(HEADS_FIRST)
    start_m = (tiles - 1 - tile) * BLOCK_M
    Q += _head_offset(bh, num_heads, stride_qb, stride_qh)
    K += _head_offset(bh, num_heads, stride_kb, stride_kh)
    V += _head_offset(bh, num_heads, stride_vb, stride_vh)
    DO += _head_offset(bh, num_heads, stride_dob, stride_doh)
    DQ += _head_offset(bh, num_heads, stride_dqb, stride_dqh)
    LSE += bh.to(tl.int64) * n_q
    DELTA += bh.to(tl.int64) * n_q

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q = _load_block(Q, start_m, n_q, stride_qn, offs_d, HEAD_DIM, HEAD_DIM_PAD, BLOCK_M, TMA)
    do = _load_block(DO, start_m, n_q, stride_don, offs_d, HEAD_DIM, HEAD_DIM_PAD, BLOCK_M, TMA)
    k_source = _tile_source(K, n_k, stride_kn, HEAD_DIM, BLOCK_N, TMA)
    v_source = _tile_source(V, n_k, stride_vn, HEAD_DIM, BLOCK_N, TMA)
    # Rows past n_q read L = D = 0: their P is finite and, with dO = 0, their dS is zero.
    lse2 = tl.load(LSE + offs_m, mask=offs_m < n_q, other=0.0) * LOG2_E
    delta = tl.load(DELTA + offs_m, mask=offs_m < n_q, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    sm_scale = tl.cast(sm_scale, tl.float32)  # Inductor passes a Python float as fp64
    qk_scale = sm_scale * LOG2_E

    unmasked_end, masked_end = _key_ranges(start_m, n_q, n_k, BLOCK_M, BLOCK_N, CAUSAL)
    for stage in tl.static_range(2):  # unrolled: each stage its own call, masked or not
        if stage == 0:  # key tiles every query row sees in full
            lo, hi = 0, unmasked_end
        else:  # the diagonal and the ragged end, masked
            lo, hi = unmasked_end, masked_end
        dq = _dq_inner(
            dq,
            q,
            do,
            lse2,
            delta,
            k_source,
            v_source,
            stride_kn,
            stride_vn,
            offs_m,
            offs_d,
            lo,
            hi,
            n_q,
            n_k,
            qk_scale,
            HEAD_DIM,
            HEAD_DIM_PAD,
            BLOCK_N,
            CAUSAL,
            stage == 1,
            TMA,
        )

    _store_rows(DQ, dq * sm_scale, offs_m, n_q, stride_dqn, offs_d, HEAD_DIM, HEAD_DIM_PAD)
