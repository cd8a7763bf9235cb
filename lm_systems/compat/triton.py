"""Triton's internals, each behind one public name (tests: tests/compat/test_triton.py). Imports no Lightning.

``CachedLaunch`` (lm_systems.attention.eager_launch) launches the compiled kernel that ``kernel[grid](...)``
returned, skipping Triton's per-call binding: a ``CompiledKernel`` launched directly is not public API.
"""

from __future__ import annotations

from typing import Any, Optional

import triton


def compiled_kernel(launched: Any) -> Optional[Any]:
    """What ``kernel[grid](*args)`` returned, if it is a compiled kernel that can be launched again directly; None
    otherwise (the interpreter, ``TRITON_INTERPRET=1``, compiles nothing)."""
    return launched if isinstance(launched, triton.compiler.CompiledKernel) else None


def launch_compiled(compiled: Any, grid: tuple[int, ...], args: tuple) -> None:
    """Launch ``compiled`` over ``grid`` with every kernel argument, in order (constexprs included): the launcher takes
    all three grid dimensions, where Triton's own path pads them with 1."""
    compiled[(*grid, 1, 1)[:3]](*args)
