"""TunedKernel: a Triton kernel launched with the best of its candidate configs, tuned once per machine.

``TunedKernel(kernel, configs, key, prune, source)[grid](*args, **kwargs)`` launches ``kernel`` with the
meta-parameters of one of ``configs``, chosen per tuning key (the values of the ``key`` arguments and the
dtypes of the tensor arguments), as ``triton.autotune`` does. The choice is looked up first in memory, then in
the ``TuningCache`` on disk (``lm_systems.attention.tuning_cache``); only when neither has it are the
candidates that ``prune`` keeps compiled and timed, under the entry's file lock, and the fastest stored. So a
second process on the same machine compiles and launches the stored config directly.

Its own tuner rather than Triton's ``triton.autotune(cache_results=True)``: that one is off in the CPU
interpreter (untestable without a GPU), raises on a damaged file, keys by architecture rather than GPU model,
shares Triton's compile cache folder (no clearing of tuning alone) and takes no lock, so two processes starting
together time their candidates against each other on the same GPU.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import triton
from triton.runtime.errors import OutOfResources, PTXASError

from lm_systems.attention.tuning_cache import TuningCache, default_cache_dir

Prune = Callable[[list[triton.Config], dict[str, Any]], list[triton.Config]]


def benchmark_ms(launch: Callable[[], Any]) -> float:
    """Median milliseconds of ``launch()``; infinite where the config cannot compile or run on this GPU."""
    try:
        return triton.testing.do_bench(launch, return_mode="median")
    except (OutOfResources, PTXASError):
        return float("inf")


def device_label(device: torch.device) -> str:
    """The GPU model and compute capability that a tuning is valid for (the CPU for the interpreter)."""
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} sm{major}{minor}"


class TunedKernel:
    """Launches ``kernel`` as ``kernel[grid](*args, **kwargs)`` with the best of ``configs`` for the tuning key.

    ``prune(configs, named_args)`` keeps the candidates that fit the arguments; ``source`` names the kernel's
    source (a hash) so that an edited kernel tunes again; ``bench(launch)`` times one candidate in ms.
    """

    def __init__(self, kernel: Any, configs: list[triton.Config], key: list[str], prune: Prune, source: str,
                 bench: Callable[[Callable[[], Any]], float] = benchmark_ms):
        self.kernel, self.configs, self.key, self.prune, self.source, self.bench = (
            kernel, configs, key, prune, source, bench)
        self.arg_names: list[str] = kernel.arg_names
        self.cache: dict[tuple, triton.Config] = {}  # this process's choices, per tuning key
        self.best_config: triton.Config | None = None  # the last launch's

    def __getitem__(self, grid) -> Callable[..., Any]:
        return lambda *args, **kwargs: self.run(grid, args, kwargs)

    def run(self, grid, args: tuple, kwargs: dict) -> Any:
        named = {**dict(zip(self.arg_names, args)), **kwargs}
        key = self.tuning_key(named)
        config = self.cache.get(key)
        if config is None:
            config = self.cache[key] = self._choose(key, grid, args, kwargs, named)
        self.best_config = config
        return self.kernel[grid](*args, **kwargs, **config.all_kwargs())

    def tuning_key(self, named: dict[str, Any]) -> tuple:
        dtypes = (str(named[name].dtype) for name in self.arg_names if isinstance(named.get(name), torch.Tensor))
        return (*(named[name] for name in self.key), *dtypes)

    def stored(self, candidates: list[triton.Config], named: dict[str, Any]) -> triton.Config | None:
        """The choice stored on this machine for these arguments among ``candidates``, if any."""
        cache = self._cache()
        if cache is None or len(candidates) < 2:
            return None
        return cache.get(self._entry(candidates, named), candidates)

    def _cache(self) -> TuningCache | None:
        root = default_cache_dir()
        return None if root is None else TuningCache(root)

    def _entry(self, candidates: list[triton.Config], named: dict[str, Any]) -> dict[str, Any]:
        device = next(value.device for value in named.values() if isinstance(value, torch.Tensor))
        return TuningCache.entry(self.kernel.__name__, self.source, device_label(device), self.tuning_key(named),
                                 candidates)

    def _choose(self, key: tuple, grid, args: tuple, kwargs: dict, named: dict) -> triton.Config:
        candidates = self.prune(self.configs, named)
        if len(candidates) == 1:
            return candidates[0]
        cache = self._cache()
        if cache is None:
            return self._fastest(candidates, grid, args, kwargs)[0]
        entry = self._entry(candidates, named)
        with cache.lock(entry):  # a process that waited here finds the entry the other one stored
            config = cache.get(entry, candidates)
            if config is None:
                config, times = self._fastest(candidates, grid, args, kwargs)
                cache.put(entry, config, times)
        return config

    def _fastest(self, candidates: list[triton.Config], grid, args: tuple, kwargs: dict):
        times = {config: self.bench(lambda: self.kernel[grid](*args, **kwargs, **config.all_kwargs()))
                 for config in candidates}
        return min(times, key=times.get), {str(config): ms for config, ms in times.items()}
