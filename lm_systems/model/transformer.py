"""TransformerLM: pre-norm decoder with RMSNorm, RoPE and SwiGLU. Plain PyTorch: no Lightning, no distributed.

Classes bottom-up: RMSNorm → RotaryEmbedding → CausalSelfAttention → SwiGLU → TransformerBlock → LMHead →
TransformerLM.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from lm_systems.attention import get_attention
from lm_systems.model.config import ModelConfig
from lm_systems.model.loss import fused_linear_cross_entropy
from lm_systems.model.recompute import AUTO_WITHOUT_PLAN, RECOMPUTE_POLICIES, run_with_recompute
from lm_systems.profiling.nvtx import nvtx_range


def _init_linear(layer: nn.Linear) -> None:
    """Truncated normal with variance 2 / (fan_in + fan_out), cut at ±3σ."""
    std = math.sqrt(2.0 / (layer.in_features + layer.out_features))
    nn.init.trunc_normal_(layer.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


class RMSNorm(nn.Module):
    """x / rms(x) · g, computed in float32 whatever the input dtype."""

    def __init__(self, d_model: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        rms = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (x32 * rms).to(x.dtype) * self.weight.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding: rotates each (x_i, x_{i + d/2}) pair by angle pos · θ^(-2i/d)."""

    def __init__(self, d_head: int, max_len: int, theta: float) -> None:
        super().__init__()
        inv_freq = theta ** (-torch.arange(0, d_head, 2, dtype=torch.float64) / d_head)  # (d/2,)
        angles = torch.arange(max_len, dtype=torch.float64)[:, None] * inv_freq[None, :]  # (max_len, d/2)
        # Not persistent: derived from the config, so checkpoints stay small and dtype casts leave them alone.
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate ``x`` (..., T, d_head) at integer ``positions`` (T,); by default 0 … T-1 (a slice, no gather)."""
        cos = self.cos[: x.shape[-2]] if positions is None else self.cos[positions]  # (T, d/2)
        sin = self.sin[: x.shape[-2]] if positions is None else self.sin[positions]
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention; the attention kernel itself is looked up by name."""

    def __init__(self, config: ModelConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.attention_name = config.attention
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.out = nn.Linear(config.d_model, config.d_model, bias=False)
        self.rope = rope

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        # 3 × (B, H, T, dh)
        q, k, v = self.qkv(x).view(B, T, 3, self.num_heads, D // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k = self.rope(q), self.rope(k)
        attend = get_attention(self.attention_name, q)
        y = attend(q, k, v, True)  # (B, H, T, dh)
        return self.out(y.transpose(1, 2).reshape(B, T, D))


class SwiGLU(nn.Module):
    """w2(silu(w1 x) ⊙ w3 x), position by position: over chunks of ``chunk_tokens`` positions where that is set."""

    def __init__(self, d_model: int, d_ff: int, chunk_tokens: int = 0) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w3 = nn.Linear(d_model, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)
        self.chunk_tokens = chunk_tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.chunk_tokens or x.shape[-2] <= self.chunk_tokens:
            return self._positions(x)
        return torch.cat([self._positions(part) for part in x.split(self.chunk_tokens, dim=-2)], dim=-2)

    def _positions(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + ffn(norm(·)); its activations kept for backward as ``recompute``
    (one of RECOMPUTE_POLICIES) says, recomputed inside this call, so hooks on the block run once."""

    def __init__(self, config: ModelConfig, rope: RotaryEmbedding, recompute: str) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model)
        self.attn = CausalSelfAttention(config, rope)
        self.ffn_norm = RMSNorm(config.d_model)
        self.ffn = SwiGLU(config.d_model, config.d_ff, config.ffn_chunk_tokens)
        self.recompute = recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_with_recompute(self._residual_branches, x, self.recompute)

    def _residual_branches(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class LMHead(nn.Linear):
    """The output projection: logits, or given the targets, their mean cross-entropy, computed over chunks of
    tokens without every position's logits where ``fused`` (``lm_systems.model.loss``). The loss is computed inside this
    module's call, so a sharding container's hooks on it gather its weight for it."""

    def __init__(self, d_model: int, vocab_size: int, fused: bool) -> None:
        super().__init__(d_model, vocab_size, bias=False)
        self.fused = fused

    def forward(self, x: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        if targets is None:
            return super().forward(x)  # (..., V)
        if self.fused:
            return fused_linear_cross_entropy(x.flatten(0, -2), self.weight, targets.flatten())
        return F.cross_entropy(super().forward(x).flatten(0, -2).float(), targets.flatten())


def _run_blocks(blocks: tuple[TransformerBlock, ...], x: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = block(x)
    return x


class TransformerLM(nn.Module):
    """Token embedding → N pre-norm blocks → RMSNorm → LM head. ``forward(tokens)`` gives logits.

    ``block_recompute``: each block's activation checkpointing policy (one of RECOMPUTE_POLICIES, a block each), as
    ``lm_systems.model.memory_budget.plan_recompute`` chooses them for ``activation_checkpointing`` auto; by default
    the config's policy for every block, and for auto, whose plan needs the card and the batch, AUTO_WITHOUT_PLAN."""

    def __init__(self, config: ModelConfig, block_recompute: Optional[Sequence[str]] = None) -> None:
        super().__init__()
        self.config = config
        if block_recompute is None:
            policy = AUTO_WITHOUT_PLAN if config.activation_checkpointing == "auto" else config.activation_checkpointing
            block_recompute = [policy] * config.num_layers
        if len(block_recompute) != config.num_layers or not set(block_recompute) <= set(RECOMPUTE_POLICIES):
            raise ValueError(
                f"block_recompute names one of {RECOMPUTE_POLICIES} for each of the {config.num_layers} blocks, got "
                f"{list(block_recompute)}"
            )
        rope = RotaryEmbedding(config.d_head, config.context_length, config.rope_theta)
        self.embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(TransformerBlock(config, rope, policy) for policy in block_recompute)
        self.final_norm = RMSNorm(config.d_model)
        self.lm_head = LMHead(config.d_model, config.vocab_size, config.fused_loss)
        # compile_blocks(runs=...): (index of the first block, the run's blocks) per run, and the compiled runner
        self._runs: Optional[list[tuple[int, tuple[TransformerBlock, ...]]]] = None
        self._run_compiled: Optional[Callable[[tuple[TransformerBlock, ...], torch.Tensor], torch.Tensor]] = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.embedding.weight, mean=0.0, std=1.0, a=-3.0, b=3.0)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                _init_linear(module)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def forward(self, tokens: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``tokens`` (B, T) int → logits (B, T, vocab_size); with ``targets`` (B, T), their mean cross-entropy."""
        T = tokens.shape[-1]
        if T > self.config.context_length:
            raise ValueError(
                f"sequence length {T} exceeds the model's context_length {self.config.context_length}: "
                "raise model.context_length or feed shorter sequences"
            )
        x = self.embedding(tokens)  # (B, T, D)
        if self._runs is None:
            for i, block in enumerate(self.blocks):
                with nvtx_range(f"block_{i}"):
                    x = block(x)
        else:
            for first, blocks in self._runs:
                with nvtx_range(f"blocks_{first}-{first + len(blocks) - 1}"):
                    x = self._run_compiled(blocks, x)
        return self.lm_head(self.final_norm(x), targets)  # (B, T, V) or ()

    def compile_blocks(self, runs: Optional[Sequence[int]] = None, **compile_options: Any) -> None:
        """torch.compile each block's forward in place (regional compilation; ``compile_options`` go to torch.compile).

        The blocks share one compiled graph, so compiling costs one block's time. Each block's backward
        stays a node of its own in the autograd graph, so its gradients arrive as it ends and a
        data-parallel container keeps overlapping their all-reduces with the rest of backward; a whole
        compiled model is one node, which hands every gradient over at the end of backward. Only the forward
        is compiled, not the module's call: hooks on a block (a sharding container's gather and free) run
        outside the graph.

        ``runs`` (sizes in order, summing to the number of blocks) compiles each run of consecutive blocks as one
        graph instead: fewer boundaries between graphs, where the activations make a round trip through memory that
        one graph fuses away, for a run's gradients all arriving as its backward ends
        (``lm_systems.parallel.runs_within_buckets`` picks runs that delay no gradient bucket). Runs of one size
        share a graph. Blocks called inside a graph run their hooks inside it: not for a sharding container.

        The plain loss (``fused_loss`` off) is compiled with the head, as the head's forward.
        """
        # The logits' cast, softmax and loss as fused kernels (the fused loss's chunk loop runs eagerly).
        if not self.config.fused_loss:
            self.lm_head.forward = torch.compile(self.lm_head.forward, **compile_options)
        if runs is None:
            for block in self.blocks:
                block.forward = torch.compile(block.forward, **compile_options)
            return
        runs = list(runs)
        if not runs or min(runs) < 1 or sum(runs) != len(self.blocks):
            raise ValueError(
                f"runs are positive numbers of blocks that add up to the model's {len(self.blocks)}, got {runs}"
            )
        firsts = itertools.accumulate([0, *runs[:-1]])
        self._runs = [
            (first, tuple(self.blocks[first : first + size])) for first, size in zip(firsts, runs, strict=True)
        ]
        self._run_compiled = torch.compile(_run_blocks, **compile_options)

    def num_parameters(self, exclude_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.embedding.weight.numel() if exclude_embedding else n

    def flops_per_token(self, context_length: int | None = None) -> float:
        """Training FLOPs per token: 6 × matmul parameters + 6 · layers · T · d_model for causal attention.

        Attention's score and value products take 4 · T · d_model FLOPs per token and layer over the whole T × T
        matrix, three times that with backward; a causal model needs the half at or below the diagonal. Model FLOPs:
        recomputation (activation checkpointing, the attention backward's) earns no credit.
        """
        c = self.config
        T = context_length or c.context_length
        matmul_params = self.num_parameters(exclude_embedding=True) - sum(
            m.weight.numel() for m in self.modules() if isinstance(m, RMSNorm)
        )
        return 6.0 * matmul_params + 6.0 * c.num_layers * T * c.d_model
