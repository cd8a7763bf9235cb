"""Name → attention function registry, with ``auto`` resolved per device."""

from __future__ import annotations

from typing import Callable

import torch

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]

_REGISTRY: dict[str, AttentionFn] = {}

# Preference order for ``auto``: the first registered name that exists is taken. On CUDA, sdpa: inside the
# training step it measured as fast as flash_triton or faster at every model shape benchmarked, contexts 512
# to 2048 (benchmarks/results/train_step.md).
_AUTO_ON_CUDA = ("sdpa",)
_AUTO_ON_CPU = ("sdpa",)


def register_attention(name: str) -> Callable[[AttentionFn], AttentionFn]:
    """Decorator: make ``fn`` available to the model as ``attention=name``."""

    def decorator(fn: AttentionFn) -> AttentionFn:
        if name in _REGISTRY or name == "auto":
            raise ValueError(f"attention {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn

    return decorator


def attention_names() -> list[str]:
    """Every name ``get_attention`` accepts, ``auto`` included."""
    return ["auto", *sorted(_REGISTRY)]


def resolve_attention_name(name: str, device: torch.device | str | None = None) -> str:
    """Map ``auto`` to the fastest correct implementation for ``device``; check other names."""
    if name == "auto":
        on_cuda = torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()
        for candidate in _AUTO_ON_CUDA if on_cuda else _AUTO_ON_CPU:
            if candidate in _REGISTRY:
                return candidate
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown attention {name!r} (set --model.attention to one of: {', '.join(attention_names())})"
        )
    return name


def get_attention(name: str, device: torch.device | str | None = None) -> AttentionFn:
    """The attention function registered as ``name`` (``auto`` resolved for ``device``)."""
    return _REGISTRY[resolve_attention_name(name, device)]
