"""CachedLaunch: eager launches of a Triton kernel that skip Triton's per-call Python work after the first.

``kernel[grid](*args, **kwargs)`` through Triton binds and specializes every argument, looks up the tuned
config (for an autotuned kernel) and the compiled kernel, and only then launches: host work that, four
launches per layer, sets the pace of an eager training step. ``CachedLaunch(kernel)[grid](*args, **kwargs)``
launches the same kernel: the first call with a given launch key goes through Triton (tuning and compiling
as usual); later calls with that key launch the compiled kernel it returned directly, with the tuned
config's meta-parameters.

The launch key is everything Triton specializes a compiled kernel on: each tensor's dtype, device and
16-byte alignment, the exact value of every other positional argument, and the keyword arguments. Tensor
shapes are not in it (Triton does not specialize on them); the grid is evaluated on every call, with the
keyword arguments and the tuned config as its meta-parameters.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from lm_systems.compat.triton import compiled_kernel, launch_compiled

# Triton specializes a pointer argument on whether its address is a multiple of 16 bytes.
POINTER_ALIGNMENT = 16
# Keys kept per kernel: enough for every shape of a training run; a sampler growing its sequence one token
# at a time past this launches the rest through Triton's own path.
MAX_KEYS = 1024


def _argument_key(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.dtype, value.device, value.data_ptr() % POINTER_ALIGNMENT == 0
    return value


class CachedLaunch:
    """Launches ``kernel`` (a ``triton.jit`` kernel, autotuned or not) as ``kernel[grid](*args, **kwargs)`` does.

    The kernel's positional arguments must come first in its signature, in order; keyword arguments and
    the tuned config's meta-parameters fill the rest.
    """

    def __init__(self, kernel: Any):
        self.kernel = kernel
        self._launches: dict[tuple, tuple[Any, tuple, dict]] = {}

    def __len__(self) -> int:
        """How many launch keys go straight to a compiled kernel."""
        return len(self._launches)

    def __getitem__(self, grid: tuple | Callable[[dict], tuple]) -> Callable[..., None]:
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid, args: tuple, kwargs: dict) -> None:
        key = (tuple(map(_argument_key, args)), tuple(kwargs.items()))
        cached = self._launches.get(key)
        if cached is None:
            self._launch_through_triton(key, grid, args, kwargs)
            return
        compiled, tail, meta = cached
        launch_compiled(compiled, grid(meta) if callable(grid) else grid, (*args, *tail))

    def _launch_through_triton(self, key: tuple, grid, args: tuple, kwargs: dict) -> None:
        compiled = compiled_kernel(self.kernel[grid](*args, **kwargs))
        config = getattr(self.kernel, "best_config", None)
        if compiled is None or len(self._launches) >= MAX_KEYS:
            return  # the interpreter compiles nothing; past MAX_KEYS every new key takes this path
        if config is not None and config.pre_hook is not None:
            return  # a pre-hook must run before each launch: leave it to Triton
        meta = {**kwargs, **(config.kwargs if config is not None else {})}
        names = self.kernel.arg_names
        if set(names[len(args) :]) != set(meta):
            raise TypeError(
                f"CachedLaunch needs every argument of the kernel, positional ones first and the rest by keyword; "
                f"missing or unknown: {sorted(set(names[len(args) :]) ^ set(meta))}"
            )
        self._launches[key] = (compiled, tuple(meta[name] for name in names[len(args) :]), meta)
