"""FlashAttention-2 in plain PyTorch: tiled online-softmax forward, recomputing backward.

The reference the Triton kernels follow step for step, and a readable statement of the algorithm
(Dao, 2023, algorithms 1 and 2). Query tiles are handled together as a batch dimension (on a GPU
they are the grid's programs); key tiles are the sequential loop that carries the online softmax.

Causal attention with ``N_q != N_k`` aligns queries to the end of the keys (query ``i`` sees keys
``j <= i + N_k - N_q``). A query that sees no key at all (only possible when ``N_q > N_k``) gets a
zero output, logsumexp ``-inf`` and zero gradients.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lm_systems.attention.flash_function import flash_attention_function
from lm_systems.attention.inputs import check_attention_inputs
from lm_systems.attention.registry import register_attention

Q_TILE = 64
"""Queries per tile."""
K_TILE = 64
"""Keys per tile: one step of the online softmax."""


def _tiles(x: torch.Tensor, tile: int) -> torch.Tensor:
    """(Z, N, d) → (Z, ceil(N / tile), tile, d), zero-padding the last tile."""
    n = x.shape[1]
    padded = F.pad(x, (0, 0, 0, -n % tile))
    return padded.view(x.shape[0], -1, tile, x.shape[2])


def _visible(n_q: int, n_k: int, k_start: int, is_causal: bool, device: torch.device) -> torch.Tensor:
    """Boolean (Tq, Q_TILE, K_TILE): which (query, key) pairs of key tile ``k_start`` take part."""
    q_pos = torch.arange(-(-n_q // Q_TILE) * Q_TILE, device=device).view(-1, Q_TILE, 1)  # (Tq, Bq, 1)
    k_pos = torch.arange(k_start, k_start + K_TILE, device=device).view(1, 1, K_TILE)  # (1, 1, Bk)
    visible = k_pos < n_k
    if is_causal:
        visible = visible & (k_pos <= q_pos + (n_k - n_q))
    return visible


def flash_forward_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled forward: O shaped like q and the logsumexp L shaped ``q.shape[:-1]`` (float32 or float64)."""
    check_attention_inputs(q, k, v, "FlashAttention2Torch")
    *lead, n_q, d = q.shape
    n_k = k.shape[-2]
    compute = torch.promote_types(q.dtype, torch.float32)  # fp32 accumulation; float64 stays exact
    scale = 1.0 / math.sqrt(d)
    q_t = _tiles(q.reshape(-1, n_q, d).to(compute), Q_TILE)  # (Z, Tq, Bq, d)
    k_f = k.reshape(-1, n_k, d).to(compute)  # (Z, N_k, d)
    v_f = v.reshape(-1, n_k, d).to(compute)

    m = torch.full(q_t.shape[:-1], float("-inf"), dtype=compute, device=q.device)  # running max (Z, Tq, Bq)
    l = torch.zeros_like(m)  # running sum of exp(s - m)
    acc = torch.zeros_like(q_t)  # unnormalised output (Z, Tq, Bq, d)
    for start in range(0, n_k, K_TILE):
        k_j = F.pad(k_f[:, start : start + K_TILE], (0, 0, 0, max(0, start + K_TILE - n_k)))  # (Z, Bk, d)
        v_j = F.pad(v_f[:, start : start + K_TILE], (0, 0, 0, max(0, start + K_TILE - n_k)))
        s = torch.einsum("ztqd,zkd->ztqk", q_t, k_j) * scale  # (Z, Tq, Bq, Bk)
        s = s.masked_fill(~_visible(n_q, n_k, start, is_causal, q.device), float("-inf"))
        # -- update the running max; rows that have seen no key yet keep -inf and contribute nothing
        m_new = torch.maximum(m, s.amax(dim=-1))
        m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
        p = torch.exp(s - m_safe[..., None])
        alpha = torch.exp(m - m_safe)
        l = alpha * l + p.sum(dim=-1)
        acc = alpha[..., None] * acc + torch.einsum("ztqk,zkd->ztqd", p, v_j)
        m = m_new

    out = acc / torch.where(l == 0, 1.0, l)[..., None]
    lse = m + torch.log(l)  # -inf for rows that see no key
    # Fresh tensors rather than views of the padded tiles: torch.compile can turn a Function whose output
    # aliases an intermediate into zero gradients (pytorch/pytorch#180642 is that family).
    out = out.reshape(out.shape[0], -1, d)[:, :n_q].reshape(*lead, n_q, d).to(q.dtype, copy=True)
    lse = lse.reshape(lse.shape[0], -1)[:, :n_q].reshape(*lead, n_q).clone()
    return out, lse


def flash_backward_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    is_causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV from P recomputed tile by tile as exp(S - L), with D = rowsum(dO ∘ O)."""
    *lead, n_q, d = q.shape
    n_k = k.shape[-2]
    compute = lse.dtype
    scale = 1.0 / math.sqrt(d)
    q_t = _tiles(q.reshape(-1, n_q, d).to(compute), Q_TILE)  # (Z, Tq, Bq, d)
    do_t = _tiles(grad_out.reshape(-1, n_q, d).to(compute), Q_TILE)
    # Padded query rows get L = 0 and dO = 0: their P is finite and their dS is zero.
    lse_t = _tiles(lse.reshape(-1, n_q, 1), Q_TILE)[..., 0]  # (Z, Tq, Bq)
    delta = (do_t * _tiles(out.reshape(-1, n_q, d).to(compute), Q_TILE)).sum(dim=-1)  # D (Z, Tq, Bq)
    k_f = k.reshape(-1, n_k, d).to(compute)
    v_f = v.reshape(-1, n_k, d).to(compute)

    dq_t = torch.zeros_like(q_t)
    dk_tiles, dv_tiles = [], []
    for start in range(0, n_k, K_TILE):
        k_j = F.pad(k_f[:, start : start + K_TILE], (0, 0, 0, max(0, start + K_TILE - n_k)))  # (Z, Bk, d)
        v_j = F.pad(v_f[:, start : start + K_TILE], (0, 0, 0, max(0, start + K_TILE - n_k)))
        s = torch.einsum("ztqd,zkd->ztqk", q_t, k_j) * scale  # (Z, Tq, Bq, Bk)
        # masked_fill after exp: a row that sees no key has L = -inf, so exp gives inf there before the fill.
        p = torch.exp(s - lse_t[..., None]).masked_fill(~_visible(n_q, n_k, start, is_causal, q.device), 0.0)
        dv_tiles.append(torch.einsum("ztqk,ztqd->zkd", p, do_t))
        dp = torch.einsum("ztqd,zkd->ztqk", do_t, v_j)
        ds = p * (dp - delta[..., None]) * scale
        dq_t = dq_t + torch.einsum("ztqk,zkd->ztqd", ds, k_j)
        dk_tiles.append(torch.einsum("ztqk,ztqd->zkd", ds, q_t))

    dq = dq_t.reshape(dq_t.shape[0], -1, d)[:, :n_q].reshape(q.shape).to(q.dtype)
    dk = torch.cat(dk_tiles, dim=1)[:, :n_k].reshape(k.shape).to(k.dtype)
    dv = torch.cat(dv_tiles, dim=1)[:, :n_k].reshape(v.shape).to(v.dtype)
    return dq, dk, dv


class FlashAttention2Torch(flash_attention_function("FlashAttention2Torch", flash_forward_torch, flash_backward_torch)):
    """FlashAttention-2 in plain PyTorch: ``FlashAttention2Torch.apply(q, k, v, is_causal)``; saves only L beside
    q, k, v, O."""


@register_attention("flash_torch")
def flash_torch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """FlashAttention-2 in plain PyTorch (tiled, recomputing backward)."""
    return FlashAttention2Torch.apply(q, k, v, is_causal)
