"""Model configuration and the named model sizes: every ``--model.*`` option of the model, stated once.

``train.py``'s ``--model.<field>`` flags are these fields, by these names: ``LitLM`` takes them as keyword arguments
and builds one ``ModelConfig`` from them, which the model and its parts read (jsonargparse shows each field's
docstring as the flag's ``--help``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal, Optional

from lm_systems.attention import attention_names
from lm_systems.model.recompute import RECOMPUTE_CHOICES


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a TransformerLM and how it runs: a named ``size`` whose shape fields left unset (None) are the size's;
    ``ModelConfig(size="small")`` or ``ModelConfig.from_name("small")`` gives a named size."""

    size: str = "tiny"
    """Named model size (tiny, small, medium, large, xl, 2.7b, 8b): the shape of every field below left unset."""
    vocab_size: Optional[int] = None
    """Rows of the embedding and LM head, at least the tokenizer's vocabulary; unset: the data's tokenizer's when
    training (the size's own, 10,000 or 151,936, for a model built without data)."""
    context_length: Optional[int] = None
    """Longest sequence the model accepts (RoPE tables are built this long); unset: the size's. The data windows
    follow it."""
    d_model: Optional[int] = None
    """Model width; unset: the size's."""
    num_layers: Optional[int] = None
    """Number of Transformer blocks; unset: the size's."""
    num_heads: Optional[int] = None
    """Attention heads; unset: the size's."""
    d_ff: Optional[int] = None
    """Hidden width of the SwiGLU feed-forward; unset: the size's."""
    rope_theta: Optional[float] = None
    """RoPE base; unset: the size's (10,000)."""
    attention: str = "auto"
    """Attention implementation by name (auto, naive, sdpa, flash_torch, flash_triton, ...:
    ``lm_systems.attention.attention_names()``)."""
    activation_checkpointing: Literal[RECOMPUTE_CHOICES] = "none"
    """What backward recomputes, not kept (``lm_systems.model.recompute``): "none"; "blocks" (each block's input kept,
    the block rerun: least memory, one more forward); "keep_attention" (as blocks, attention outputs kept: their
    recompute costs most at long context); "selective" (matmul and attention outputs kept, the rest rerun);
    "keep_projections" (as selective but w2's output, which backward never needs: the same work, less kept); "auto"
    (per block, the most that fits memory_budget: the later blocks keep more; eager, without the selective levels where
    their dispatch costs more than the recompute they save; one line at start says how many blocks got each policy
    and the predicted peak)."""
    memory_budget: float = 0.9
    """With activation_checkpointing auto, the memory one GPU may use: a fraction of the card when at most 1 (0.9:
    90%), GiB above 1 (e.g. 120). Counted against it: parameters, gradients and AdamW state (divided over the GPUs by
    zero3 and fsdp2), the kept activations, one block's backward and the loss. Without CUDA a fraction cannot be
    resolved: give GiB, or auto keeps each block's input only (as "blocks")."""
    fused_loss: bool = True
    """The LM head and cross-entropy over chunks of tokens, never holding every position's logits (at vocabulary V and
    N tokens the plain loss holds N × V float32 logits and their gradient; ``lm_systems.model.loss``); false computes
    the logits, then the cross-entropy."""
    ffn_chunk_tokens: int = 0
    """The feed-forward over chunks of this many positions (0: all at once): at long context, fewer of its d_ff-wide
    intermediates alive at once when backward recomputes them."""

    def __post_init__(self) -> None:
        if self.size not in _SIZE_SHAPES:
            raise ValueError(
                f"unknown model size {self.size!r} (set --model.size to one of: {', '.join(_SIZE_SHAPES)})"
            )
        for name, value in _SIZE_SHAPES[self.size].items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        self._check()

    def _check(self) -> None:
        if self.attention not in attention_names():  # checked here only: the model and the registry trust it
            raise ValueError(
                f"unknown attention {self.attention!r} (set --model.attention to one of: "
                f"{', '.join(attention_names())})"
            )
        if self.activation_checkpointing not in RECOMPUTE_CHOICES:
            raise ValueError(
                f"unknown activation checkpointing {self.activation_checkpointing!r} (set "
                f"--model.activation_checkpointing to one of: {', '.join(RECOMPUTE_CHOICES)})"
            )
        if not self.memory_budget > 0:
            raise ValueError(
                "--model.memory_budget must be a fraction of the card (0 < b <= 1) or GiB (> 1), "
                f"got {self.memory_budget}"
            )
        for name in ("vocab_size", "context_length", "d_model", "num_layers", "num_heads", "d_ff"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--model.{name} must be positive, got {getattr(self, name)}")
        if self.ffn_chunk_tokens < 0:
            raise ValueError(f"--model.ffn_chunk_tokens must be 0 (no chunks) or positive, got {self.ffn_chunk_tokens}")
        if self.d_model % self.num_heads:
            raise ValueError(f"model.d_model ({self.d_model}) must be divisible by model.num_heads ({self.num_heads})")
        if self.d_head % 2:
            raise ValueError(
                f"RoPE needs an even head dimension, got d_model/num_heads = {self.d_head}: "
                "change model.d_model or model.num_heads"
            )

    @property
    def d_head(self) -> int:
        return self.d_model // self.num_heads

    @classmethod
    def from_name(cls, name: str, **overrides) -> "ModelConfig":
        """The named size ``name`` with any field overridden (``None`` overrides leave the size's)."""
        known = {f.name for f in fields(cls)} - {"size"}
        unknown = set(overrides) - known
        if unknown:
            raise ValueError(f"unknown model config keys {sorted(unknown)}; valid keys: {sorted(known)}")
        return cls(size=name, **overrides)


_CS336 = dict(vocab_size=10_000, context_length=256, rope_theta=10_000.0)
_SIZE_SHAPES: dict[str, dict[str, int | float]] = {
    # Trains in about a minute on two CPU cores.
    "tiny": dict(_CS336, context_length=128, d_model=128, num_layers=4, num_heads=4, d_ff=512),
    # The CS336 sizes (GPT-2 small … 2.7B shapes, vocab 10,000).
    "small": dict(_CS336, d_model=768, num_layers=12, num_heads=12, d_ff=3072),
    "medium": dict(_CS336, d_model=1024, num_layers=24, num_heads=16, d_ff=4096),
    "large": dict(_CS336, d_model=1280, num_layers=36, num_heads=20, d_ff=5120),
    "xl": dict(_CS336, d_model=1600, num_layers=48, num_heads=25, d_ff=6400),
    "2.7b": dict(_CS336, d_model=2560, num_layers=32, num_heads=32, d_ff=10240),
    # The CS336 2026 leaderboard's 8B shape (vocab 151,936; context 32,768).
    "8b": dict(
        vocab_size=151_936,
        context_length=32_768,
        d_model=4096,
        num_layers=34,
        num_heads=32,
        d_ff=11_008,
        rope_theta=1e4,
    ),
}
"""Each named size's shape: the values of ``ModelConfig``'s fields left unset."""

MODEL_SIZES: dict[str, ModelConfig] = {name: ModelConfig(size=name) for name in _SIZE_SHAPES}
"""Each named size, its vocabulary the size's own."""
