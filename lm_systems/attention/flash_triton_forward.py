"""Triton forward kernel of FlashAttention-2, and the tile helpers the backward kernels share.

Layout: q, k, v, O, dO are (B, H, N, d) with the last dim contiguous and any other strides; L and D
are (B·H, N_q) float32. The head dim is padded to ``HEAD_DIM_PAD`` (a power of two) with masked
loads and stores. Softmax runs in base 2: the scores are multiplied by ``sm_scale · log2(e)`` and
exponentiated with exp2; L is stored in natural log, so callers see the ordinary logsumexp.

Causal masking (queries end-aligned, query i sees keys j <= i + N_k - N_q) visits tiles in two
stages: tiles every row of the program sees, with no mask at all, then the few tiles along the
diagonal (and the ragged end of the sequence) with one. Fully masked tiles are never visited.
Kernels take their tile sizes as constexprs; ``tuning`` picks them. The backward
kernels live in ``flash_triton_backward``. Sequence lengths and the head count are not specialised
on (``do_not_specialize``): one binary serves every length, instead of one per divisibility class.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2_E: tl.constexpr = tl.constexpr(1.4426950408889634)  # 1/ln(2): e^x = 2^(x · LOG2_E)
LN_2: tl.constexpr = tl.constexpr(0.6931471805599453)

# fp32 inputs: three tf32 tensor-core products recover about fp32 accuracy at a fraction of the
# cost of the CUDA-core fp32 ("ieee") path; fp16/bf16 inputs ignore this setting.
FP32_DOT_PRECISION: tl.constexpr = tl.constexpr("tf32x3")


@triton.jit
def _load_rows(
    ptrs, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, CHECK_ROWS: tl.constexpr
):
    """Load a (rows, HEAD_DIM_PAD) tile, zero past ``n_rows`` (if CHECK_ROWS) and past HEAD_DIM."""
    if CHECK_ROWS:
        mask = rows[:, None] < n_rows
        if HEAD_DIM != HEAD_DIM_PAD:
            mask = mask & (offs_d[None, :] < HEAD_DIM)
        tile = tl.load(ptrs, mask=mask, other=0.0)
    elif HEAD_DIM != HEAD_DIM_PAD:
        tile = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def _store_rows(X, tile, rows, n_rows, stride_n, offs_d, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """Store a (rows, HEAD_DIM_PAD) float32 tile into X's ``rows`` in X's dtype, none past ``n_rows`` or HEAD_DIM."""
    mask = rows[:, None] < n_rows
    if HEAD_DIM != HEAD_DIM_PAD:
        mask = mask & (offs_d[None, :] < HEAD_DIM)
    tl.store(X + rows[:, None] * stride_n + offs_d[None, :], tile.to(X.dtype.element_ty), mask=mask)


@triton.jit
def _program_tile(HEADS_FIRST: tl.constexpr):
    """(tile index, tile count, batch·head index) of this program; HEADS_FIRST: the grid is (B·H, tiles)."""
    if HEADS_FIRST:
        return tl.program_id(1), tl.num_programs(1), tl.program_id(0)
    else:
        return tl.program_id(0), tl.num_programs(0), tl.program_id(1)


@triton.jit
def _head_offset(bh, num_heads, stride_b, stride_h):
    """Where batch·head ``bh``'s (N, d) slice starts in a (B, H, N, d) tensor of these strides, in int64 (a
    tensor's B·H·N·d may pass 2^31). Every kernel moves each of its tensors to its program's slice with this."""
    b = (bh // num_heads).to(tl.int64)
    h = (bh % num_heads).to(tl.int64)
    return b * stride_b + h * stride_h


@triton.jit
def _key_ranges(start_m, n_q, n_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """For query rows [start_m, start_m + BLOCK_M): keys [0, a) need no mask; keys [a, b) need one."""
    full_end = (n_k // BLOCK_N) * BLOCK_N  # key tiles with no ragged end
    if CAUSAL:
        shift = n_k - n_q
        # Every row of the block sees keys j <= start_m + shift; the last row sees up to start_m + BLOCK_M - 1 + shift.
        unmasked_end = tl.minimum(tl.maximum((start_m + shift + 1) // BLOCK_N * BLOCK_N, 0), full_end)
        masked_end = tl.minimum(tl.maximum(start_m + BLOCK_M + shift, 0), n_k)
    else:
        unmasked_end = full_end
        masked_end = n_k
    return unmasked_end, masked_end


@triton.jit
def _attn_fwd_inner(
    acc,
    l_i,
    m_i,
    q,
    K,
    V,
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
):
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k = _load_rows(
            K + cols[:, None] * stride_kn + offs_d[None, :], cols, n_k, offs_d, HEAD_DIM, HEAD_DIM_PAD, MASKED
        )
        s = tl.dot(q, tl.trans(k), input_precision=FP32_DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        # -- new running max, then probabilities relative to it
        if MASKED:
            visible = cols[None, :] < n_k
            if CAUSAL:
                visible = visible & (cols[None, :] <= offs_m[:, None] + (n_k - n_q))
            s = tl.where(visible, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row that has seen no key keeps m = -inf; subtracting 0 instead avoids inf - inf.
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_ref[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            m_ref = m_new
            p = tl.math.exp2(s * qk_scale - m_ref[:, None])
        # -- rescale what was accumulated under the old max
        alpha = tl.math.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = _load_rows(
            V + cols[:, None] * stride_vn + offs_d[None, :], cols, n_k, offs_d, HEAD_DIM, HEAD_DIM_PAD, MASKED
        )
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=FP32_DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["num_heads", "n_q", "n_k", "N_Q_KEY", "N_K_KEY"])
def attn_fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_ob,
    stride_oh,
    stride_on,
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
):
    """One program: BLOCK_M query rows of one (batch, head); writes O and L for them."""
    # Last query tiles first: under a causal mask they have the most keys to visit, and starting the
    # longest programs first leaves short ones, not long ones, for the tail of the launch.
    tile, tiles, bh = _program_tile(HEADS_FIRST)
    start_m = (tiles - 1 - tile) * BLOCK_M
    Q += _head_offset(bh, num_heads, stride_qb, stride_qh)
    K += _head_offset(bh, num_heads, stride_kb, stride_kh)
    V += _head_offset(bh, num_heads, stride_vb, stride_vh)
    O += _head_offset(bh, num_heads, stride_ob, stride_oh)
    LSE += bh.to(tl.int64) * n_q

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q = _load_rows(Q + offs_m[:, None] * stride_qn + offs_d[None, :], offs_m, n_q, offs_d, HEAD_DIM, HEAD_DIM_PAD, True)
    sm_scale = tl.cast(sm_scale, tl.float32)  # Inductor passes a Python float as fp64
    qk_scale = sm_scale * LOG2_E
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

    unmasked_end, masked_end = _key_ranges(start_m, n_q, n_k, BLOCK_M, BLOCK_N, CAUSAL)
    for stage in tl.static_range(2):  # unrolled: each stage its own call, masked or not
        if stage == 0:  # tiles every row sees in full
            lo, hi = 0, unmasked_end
        else:  # the diagonal and the ragged end, masked
            lo, hi = unmasked_end, masked_end
        acc, l_i, m_i = _attn_fwd_inner(
            acc,
            l_i,
            m_i,
            q,
            K,
            V,
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
        )

    # -- epilogue: rows that saw no key (causal with N_q > N_k) get O = 0 and L = -inf
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN_2)
    tl.store(LSE + offs_m, lse, mask=offs_m < n_q)
    _store_rows(O, out, offs_m, n_q, stride_on, offs_d, HEAD_DIM, HEAD_DIM_PAD)
