"""lm_systems: GPT-style Transformer LMs with home-made attention kernels and data parallelism.

``from lm_systems import TransformerLM, ModelConfig, LitLM``: each is imported on first use, so importing the
model (plain PyTorch) never loads Lightning.
"""

from importlib import import_module

_PUBLIC = {
    "TransformerLM": "lm_systems.model.transformer",
    "ModelConfig": "lm_systems.model.config",
    "LitLM": "lm_systems.lit_module",
}
__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
