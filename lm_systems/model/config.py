"""Model configuration and the named model sizes."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from lm_systems.attention import attention_names
from lm_systems.model.recompute import RECOMPUTE_CHOICES


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a TransformerLM; ``ModelConfig.from_name("small")`` gives a named size."""

    vocab_size: int = 10_000
    """Rows of the embedding and LM head; at least the tokenizer's vocabulary."""
    context_length: int = 256
    """Longest sequence the model accepts (RoPE tables are built this long)."""
    d_model: int = 768
    num_layers: int = 12
    num_heads: int = 12
    d_ff: int = 3072
    """Hidden width of the SwiGLU feed-forward."""
    rope_theta: float = 10_000.0
    attention: str = "auto"
    """Attention implementation by name (``lm_systems.attention.attention_names()``)."""
    activation_checkpointing: str = "none"
    """What backward recomputes instead of keeping: one of ``lm_systems.model.recompute.RECOMPUTE_CHOICES``; ``auto``
    chooses a policy per block, the most each can keep within ``memory_budget`` (``lm_systems.model.memory_budget``)."""
    memory_budget: float = 0.9
    """With ``activation_checkpointing`` auto, the memory one GPU may use: a fraction of its card (at most 1) or GiB
    (above 1). A fraction needs the card's size: without CUDA, auto keeps ``blocks``'s bytes (its first fallback)."""
    fused_loss: bool = True
    """The LM head and cross-entropy over chunks of tokens, never holding every position's logits
    (``lm_systems.model.loss``); False computes the logits, then the cross-entropy."""
    ffn_chunk_tokens: int = 0
    """The feed-forward over chunks of this many positions (0: all at once): fewer of its d_ff-wide intermediates
    alive at once when backward recomputes them, where long contexts peak."""

    def __post_init__(self) -> None:
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
        """The named size ``name`` with any field overridden (``None`` overrides are ignored)."""
        if name not in MODEL_SIZES:
            raise ValueError(f"unknown model size {name!r} (set --model.size to one of: {', '.join(MODEL_SIZES)})")
        known = {f.name for f in fields(cls)}
        unknown = set(overrides) - known
        if unknown:
            raise ValueError(f"unknown model config keys {sorted(unknown)}; valid keys: {sorted(known)}")
        return replace(MODEL_SIZES[name], **{k: v for k, v in overrides.items() if v is not None})


MODEL_SIZES: dict[str, ModelConfig] = {
    # Trains in about a minute on two CPU cores.
    "tiny": ModelConfig(context_length=128, d_model=128, num_layers=4, num_heads=4, d_ff=512),
    # The CS336 sizes (GPT-2 small … 2.7B shapes, vocab 10,000).
    "small": ModelConfig(d_model=768, num_layers=12, num_heads=12, d_ff=3072),
    "medium": ModelConfig(d_model=1024, num_layers=24, num_heads=16, d_ff=4096),
    "large": ModelConfig(d_model=1280, num_layers=36, num_heads=20, d_ff=5120),
    "xl": ModelConfig(d_model=1600, num_layers=48, num_heads=25, d_ff=6400),
    "2.7b": ModelConfig(d_model=2560, num_layers=32, num_heads=32, d_ff=10240),
    # The CS336 2026 leaderboard's 8B shape (vocab 151,936; context 32,768).
    "8b": ModelConfig(
        vocab_size=151_936, context_length=32_768, d_model=4096, num_layers=34, num_heads=32, d_ff=11_008
    ),
}
