"""Activation checkpointing for a memory budget (``--model.activation_checkpointing auto``): per block, the policy that
keeps the most for backward that fits.

What each policy keeps of a block is counted from the model's shape (``kept_bytes_per_token``). What a GPU holds besides
(``MemoryNeeds``: parameters and optimizer state throughout, gradients as backward makes them while it frees the kept
activations, the transient of one block's backward or of the loss) gives the step's peak for any choice;
``plan_recompute`` gives every block the policy of the highest level all of them fit the budget at, and as many of the
last blocks as still fit the level above. Levels in the order they keep
more, each buying less recompute a byte than the one before it: ``blocks`` (the input), ``keep_attention`` (+ the
attention's output: its recompute costs most at long context), ``keep_projections`` (+ the outputs of qkv, out, w1
and w3: d_model FLOPs of recompute a byte each), ``none`` (+ the elementwise intermediates, the cheapest to
recompute). The later blocks keep more: backward reaches them first,
while every block's kept activations are still held.

Eager, the two selective levels cost time ``blocks`` does not: torch.utils.checkpoint's selective context sends each
of the block's operations through a Python dispatch mode. ``paying_levels`` leaves out of an eager run's plan a
selective level whose recompute saved (at the GPU's rate) is worth less than that (docs/memory_budget.md).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from lm_systems.model.config import ModelConfig
from lm_systems.model.loss import CHUNK_LOGITS_BYTES
from lm_systems.model.recompute import RECOMPUTE_POLICIES

GIB = 2**30
LEVELS = ("blocks", "keep_attention", "keep_projections", "none")
"""The policies ``auto`` chooses among, in the order they keep more (not ``selective``: it keeps w2's output too, which
saves no recompute)."""
SELECTIVE_LEVELS = ("keep_attention", "keep_projections")
EAGER_SELECTIVE_OVERHEAD_S = 4e-3
"""What an eager block under a selective level costs beyond ``blocks`` in dispatch, each micro-batch (measured:
docs/memory_budget.md). Compiled, the context is traced away."""
RECOMPUTE_SHARE_OF_PEAK = 0.5
"""The share of a GPU's dense peak a block's recompute runs at (the compiled 8B step's: docs/memory_budget.md)."""


def kept_bytes_per_token(
    config: ModelConfig, policy: str, activation_bytes: int, parameter_bytes: Optional[int] = None
) -> int:
    """Bytes a block keeps for backward per position under ``policy``, its activations ``activation_bytes`` wide and
    its parameters ``parameter_bytes`` (the activations' width without it).

    Counted as eager PyTorch saves them, with SDPA's softmax statistics (float32; float64 for a float64 model). Exact
    where parameters and activations share one dtype (tests/test_memory_budget.py measures them). Under autocast
    (float32 parameters, narrower activations) the residual stream is float32: the block's input is kept that wide,
    and ``none`` keeps float32 copies beside its casts (three residual-wide tensors more, as measured under the CPU's
    autocast: tests/test_memory_budget.py); ``kept_bytes_per_block`` adds the casts of the block's weights.
    """
    D, F, e = config.d_model, config.d_ff, activation_bytes
    widen = D * ((parameter_bytes or e) - e)  # the residual stream wider than the activations: float32 under autocast
    stats = config.num_heads * (8 if e == 8 else 4)
    if policy == "blocks":  # the block's input
        return D * e + widen
    if policy == "keep_attention":  # + the attention's output and statistics
        return 2 * D * e + stats + widen
    if policy == "keep_projections":  # + the outputs of qkv (3D), out (D), w1 and w3 (F each)
        return (6 * D + 2 * F) * e + stats + widen
    if policy == "selective":  # + w2's (D)
        return (7 * D + 2 * F) * e + stats + widen
    if policy == "none":
        # Each RMSNorm: its float32 input and statistic, its normalised output and that times the weight; attention:
        # qkv, the rotated q and k, its output and statistics, the output's (B, T, D) copy; the SwiGLU: w1's and w3's
        # outputs, the SiLU and the product.
        norms = 2 * (4 * D + 4 + 2 * D * e)
        return norms + (3 + 2 + 1 + 1) * D * e + stats + 4 * F * e + 3 * widen
    raise ValueError(f"unknown recompute policy {policy!r}: one of {RECOMPUTE_POLICIES}")


def kept_bytes_per_block(
    config: ModelConfig, policy: str, tokens: int, activation_bytes: int, parameter_bytes: Optional[int] = None
) -> int:
    """Bytes a block keeps for backward over ``tokens`` positions: ``kept_bytes_per_token``'s, and under autocast
    (parameters wider than the activations) a block that keeps everything (``none``) keeps the casts of its weights
    too, which its matmuls saved (a recomputing block casts them again in its backward)."""
    kept = tokens * kept_bytes_per_token(config, policy, activation_bytes, parameter_bytes)
    if policy == "none" and (parameter_bytes or activation_bytes) != activation_bytes:
        kept += block_parameter_count(config) * activation_bytes
    return kept


def recompute_saved_flops(config: ModelConfig, level: str, tokens: int) -> int:
    """FLOPs of one block's forward over ``tokens`` positions that a selective ``level`` keeps the results of and
    ``blocks`` recomputes: the attention (Q Kᵀ and P V over the causal half of the scores), and from
    keep_projections on the qkv, out, w1 and w3 matmuls."""
    D, F = config.d_model, config.d_ff
    attention = 2 * tokens * config.context_length * D
    if level == "keep_attention":
        return attention
    if level == "keep_projections":
        return attention + 2 * tokens * (4 * D * D + 2 * D * F)
    raise ValueError(f"{level!r} is not a selective level: one of {SELECTIVE_LEVELS}")


def paying_levels(config: ModelConfig, tokens: int, eager_recompute_rate: Optional[float]) -> tuple[str, ...]:
    """LEVELS without the selective ones an eager run recomputing at ``eager_recompute_rate`` FLOP/s would pay more
    dispatch for than they save; all of them where there is no such rate (compiled, or a device of unknown peak)."""
    if eager_recompute_rate is None:
        return LEVELS
    return tuple(
        level
        for level in LEVELS
        if level not in SELECTIVE_LEVELS
        or recompute_saved_flops(config, level, tokens) / eager_recompute_rate > EAGER_SELECTIVE_OVERHEAD_S
    )


def block_parameter_count(config: ModelConfig) -> int:
    """The parameters of one block: four attention and three feed-forward matrices, two norms."""
    D, F = config.d_model, config.d_ff
    return 4 * D * D + 3 * D * F + 2 * D


def parameter_count(config: ModelConfig) -> int:
    """The parameters of a TransformerLM of ``config``: embedding and LM head (untied), the blocks, the final norm."""
    return 2 * config.vocab_size * config.d_model + config.num_layers * block_parameter_count(config) + config.d_model


def transient_bytes(config: ModelConfig, batch_size: int, activation_bytes: int, residual_bytes: int) -> int:
    """What is alive for a moment on top of the kept activations: the larger of one block's backward (its recompute,
    every activation of the block, and their gradients; the feed-forward's over its chunks of positions) and the loss
    (the fused loss's chunk of float32 logits and its gradient; the plain loss's logits of every position and their
    gradient in the activations' dtype, the float32 softmax fused into the compiled kernels). An estimate: which of
    these a compiled graph keeps alive at once is the compiler's choice."""
    T, D, F, e = config.context_length, config.d_model, config.d_ff, activation_bytes
    tokens = batch_size * T
    ffn_tokens = batch_size * min(T, config.ffn_chunk_tokens or T)
    block = tokens * (kept_bytes_per_token(config, "none", e) - 4 * F * e) + ffn_tokens * 7 * F * e
    block += 2 * tokens * D * residual_bytes  # the gradient of the residual stream in and out
    if config.fused_loss:
        loss = 2 * min(CHUNK_LOGITS_BYTES, tokens * config.vocab_size * 4)
    else:
        loss = 2 * tokens * config.vocab_size * e
    return max(block, loss)


@dataclass(frozen=True)
class MemoryNeeds:
    """What one GPU holds besides the blocks' kept activations, in bytes (its shard where a strategy shards them)."""

    resident: int  # parameters and optimizer state, held throughout the step
    block_gradient: int  # one block's gradients, made as its backward runs and held until the optimizer's step
    end_gradient: int  # the LM head's gradients (made first in backward) and the embedding's (made last), each
    transient: int  # the largest momentary need on top of all that (``transient_bytes``)
    gradients_held: bool = False  # accumulating over micro-batches: every gradient is held from the first one on

    def peak(self, kept: Sequence[int]) -> int:
        """The peak of a step whose blocks keep ``kept`` bytes each, in order. Backward frees the blocks' kept
        activations from the last block down while their gradients arrive: before block i's backward, blocks 0 … i
        still hold theirs and blocks i+1 … their gradients (every block's, and both ends', when they are held)."""
        layers, held = len(kept), list(itertools.accumulate(kept, initial=0))
        made = [layers if self.gradients_held else layers - 1 - i for i in range(layers)]
        during = max(held[i + 1] + made[i] * self.block_gradient for i in range(layers))
        ends = (2 if self.gradients_held else 1) * self.end_gradient
        after = layers * self.block_gradient + self.end_gradient  # every gradient, the embedding's included
        return self.resident + max(during + ends + self.transient, after + self.end_gradient)


@dataclass(frozen=True)
class RecomputePlan:
    """Each block's policy and what it predicts a GPU's peak to be."""

    block_recompute: tuple[str, ...]
    kept: tuple[int, ...]  # each block's kept activations, bytes
    needs: MemoryNeeds
    budget: int
    left_out: tuple[str, ...] = ()  # selective levels not worth their dispatch in this eager run, where it mattered

    @property
    def predicted_peak(self) -> int:
        return self.needs.peak(self.kept)

    def describe(self) -> str:
        """One line: how many blocks keep what, and the predicted peak against the budget."""
        counts = Counter(self.block_recompute)
        blocks = ", ".join(f"{counts[level]} {level}" for level in LEVELS if counts[level])
        order = " (the later blocks keep more)" if len(counts) > 1 else ""
        over = " OVER the budget: even blocks' recompute keeps too much;" if self.predicted_peak > self.budget else ""
        if self.left_out:
            over += f" {' and '.join(self.left_out)} left out (eager: their dispatch costs more than they save);"
        resident, kept, transient = (
            value / GIB for value in (self.needs.resident, sum(self.kept), self.needs.transient)
        )
        return (
            f"activation checkpointing auto, {len(self.block_recompute)} blocks: {blocks}{order}; predicted peak "
            f"{self.predicted_peak / GIB:.1f} GiB of a budget of {self.budget / GIB:.1f};{over} parameters and "
            f"optimizer state {resident:.1f}, kept activations {kept:.1f}, transient {transient:.1f}"
        )


def plan_recompute(
    config: ModelConfig,
    batch_size: int,
    activation_bytes: int,
    budget: int,
    needs: MemoryNeeds,
    parameter_bytes: Optional[int] = None,
    eager_recompute_rate: Optional[float] = None,
) -> RecomputePlan:
    """Per block, the most that fits ``budget`` bytes beside ``needs`` (see the module's doc), among the levels that
    pay (``paying_levels``: an eager run gives the FLOP/s it recomputes at); every block ``blocks`` where not even
    that fits (the plan says the predicted peak is over the budget)."""
    tokens = batch_size * config.context_length
    choices = paying_levels(config, tokens, eager_recompute_rate)
    per_block = [kept_bytes_per_block(config, level, tokens, activation_bytes, parameter_bytes) for level in choices]
    layers = config.num_layers

    def levels(level: int, upper: int) -> tuple[int, ...]:  # the last ``upper`` blocks one level up
        return (level,) * (layers - upper) + (min(level + 1, len(choices) - 1),) * upper

    def fits(plan: tuple[int, ...]) -> bool:
        return needs.peak([per_block[level] for level in plan]) <= budget

    level = max((i for i in range(len(choices)) if fits(levels(i, 0))), default=0)
    upper = max((n for n in range(layers + 1) if level + 1 < len(choices) and fits(levels(level, n))), default=0)
    chosen = levels(level, upper)
    policies, kept = tuple(choices[i] for i in chosen), tuple(per_block[i] for i in chosen)
    left_out = tuple(name for name in LEVELS if name not in choices) if set(policies) != {"none"} else ()
    return RecomputePlan(policies, kept, needs, budget, left_out)
