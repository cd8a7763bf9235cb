"""NVTX ranges that cost nothing unless profiling switches them on (``callbacks.NVTXRanges``)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import ContextManager

import torch

_enabled = False


def set_nvtx_enabled(enabled: bool) -> None:
    """Turn the library's NVTX ranges on or off (only takes effect where CUDA is available)."""
    global _enabled
    _enabled = bool(enabled) and torch.cuda.is_available()


def nvtx_range(name: str) -> ContextManager:
    """``torch.cuda.nvtx.range(name)`` when enabled, else a no-op context."""
    return torch.cuda.nvtx.range(name) if _enabled else nullcontext()
