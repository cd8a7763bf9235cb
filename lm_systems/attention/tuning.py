"""Tuning the flash_triton kernels: candidate tile configs, the prune rules, the choice kept on disk per machine.

Each kernel (forward, dQ, dK/dV) is tuned per (query-length bucket, key-length bucket, head dim, causal, dtypes).
The buckets are the next power of two, so a training run with a fixed context tunes once and odd lengths share the
tuning of their bucket. fp16 and bf16 are tuned; fp32 always takes the small last config.

- ``TuningCache``: the chosen configs on disk, one JSON file per (kernel, kernel source, Triton version, GPU model
  and capability, tuning key, candidate configs). A change to any of them names another file, so nothing stale is
  read: a new Triton, another GPU, an edited kernel or a new candidate list tunes afresh. Location:
  ``$LM_SYSTEMS_TUNING_CACHE`` if set (``off`` turns the cache off), else ``$XDG_CACHE_HOME/lm_systems/triton_tuning``
  (``~/.cache/lm_systems/triton_tuning``). Entries are written atomically (a temporary file renamed into place),
  and tuning one entry holds a file lock, so that two processes starting together tune it once, not side by side
  on the same GPU with each other's timings. A damaged entry is reported, ignored and tuned again.
  ``python -m lm_systems.attention.tune`` tunes ahead of a run or, with ``--clear``, deletes the folder.
- ``TunedKernel(kernel, configs, key, prune, source)[grid](*args, **kwargs)``: eager launches with one of
  ``configs`` chosen per tuning key (the values of the ``key`` arguments and the dtypes of the tensor arguments),
  as ``triton.autotune`` does. The choice is looked up first in memory, then in the ``TuningCache``; only when
  neither has it are the candidates that ``prune`` keeps compiled and timed, under the entry's file lock, and the
  fastest stored. So a second process on the same machine compiles and launches the stored config directly.
  Its own tuner rather than Triton's ``triton.autotune(cache_results=True)``: that one is off in the CPU
  interpreter (untestable without a GPU), raises on a damaged file, keys by architecture rather than GPU model,
  shares Triton's compile cache folder (no clearing of tuning alone) and takes no lock, so two processes starting
  together time their candidates against each other on the same GPU.
- ``TUNED_FOR_EAGER`` / ``TUNED_FOR_COMPILE``: each kernel as eager calls launch it (a ``TunedKernel``) and as
  torch.compile's graphs launch it (a ``triton.autotune`` kernel, which Inductor tunes over the same pruned
  candidates, or which takes the choice stored on this machine where there is one).

Set ``LM_SYSTEMS_FLASH_AUTOTUNE=0`` to skip tuning and take each kernel's first candidate that fits (useful for
tests over many shapes, where compiling every candidate costs more than the tests). Under ``TRITON_INTERPRET=1``
one small config is used: the interpreter runs on the CPU, where timing candidates means nothing, and small
unequal tiles exercise the tile logic (several query and key tiles, diagonal tiles, ragged ends) at the tiny test
sizes.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import triton
from filelock import FileLock
from triton.runtime.errors import OutOfResources, PTXASError
from triton.runtime.interpreter import InterpretedFunction

from lm_systems.attention import flash_triton_backward, flash_triton_forward
from lm_systems.attention.flash_triton_backward import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel
from lm_systems.attention.flash_triton_forward import attn_fwd_kernel
from lm_systems.files.atomic_files import write_json_atomic
from lm_systems.files.fingerprint import fingerprint

CACHE_ENV = "LM_SYSTEMS_TUNING_CACHE"
OFF = ("off", "0", "false", "no")


def default_cache_dir() -> Path | None:
    """Where the tuning cache lives on this machine, or None when ``$LM_SYSTEMS_TUNING_CACHE`` turns it off."""
    chosen = os.environ.get(CACHE_ENV)
    if chosen is not None:
        return None if chosen.strip().lower() in OFF else Path(chosen).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lm_systems" / "triton_tuning"


class TuningCache:
    """Tuned configs on disk under ``root``: ``get`` / ``put`` an entry, ``lock`` it while tuning."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    @staticmethod
    def entry(kernel: str, source: str, device: str, key: tuple, candidates: list[triton.Config]) -> dict[str, Any]:
        """What identifies one tuning: everything a stored choice depends on."""
        return {
            "kernel": kernel,
            "source": source,
            "triton": triton.__version__,
            "device": device,
            "key": [str(part) for part in key],
            "candidates": [str(config) for config in candidates],
        }

    def path(self, entry: dict[str, Any]) -> Path:
        return self.root / f"{entry['kernel']}-{fingerprint(entry, length=24)}.json"

    def lock(self, entry: dict[str, Any]) -> FileLock:
        self.root.mkdir(parents=True, exist_ok=True)
        return FileLock(str(self.path(entry).with_suffix(".lock")))

    def get(self, entry: dict[str, Any], candidates: list[triton.Config]) -> triton.Config | None:
        """The stored choice among ``candidates``, or None when there is none (or it is damaged)."""
        path = self.path(entry)
        try:
            stored = json.loads(path.read_text())
            if stored["entry"] != entry:
                raise ValueError("it belongs to another tuning")
            return candidates[entry["candidates"].index(stored["chosen"])]
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as error:  # ValueError: bad JSON, a choice not a candidate
            warnings.warn(f"ignoring the damaged tuning cache entry {path} ({error}); tuning again", stacklevel=2)
            return None

    def put(self, entry: dict[str, Any], chosen: triton.Config, times_ms: dict[str, float]) -> None:
        """Store ``chosen`` (and every candidate's time, for a person reading the file)."""
        write_json_atomic(self.path(entry), {"entry": entry, "chosen": str(chosen), "times_ms": times_ms})

    def clear(self) -> int:
        """Delete every entry (with the locks and any temporary file a crash left); the number of entries deleted."""
        if not self.root.is_dir():
            return 0
        entries = list(self.root.glob("*.json"))
        for path in [*entries, *self.root.glob("*.lock"), *self.root.glob("*.tmp-*")]:
            path.unlink(missing_ok=True)
        return len(entries)


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

    def __init__(
        self,
        kernel: Any,
        configs: list[triton.Config],
        key: list[str],
        prune: Prune,
        source: str,
        bench: Callable[[Callable[[], Any]], float] = benchmark_ms,
    ):
        self.kernel, self.configs, self.key, self.prune, self.source, self.bench = (
            kernel,
            configs,
            key,
            prune,
            source,
            bench,
        )
        self.arg_names: list[str] = kernel.arg_names
        self.cache: dict[tuple, triton.Config] = {}  # this process's choices, per tuning key
        self.best_config: triton.Config | None = None  # the last launch's

    def __getitem__(self, grid) -> Callable[..., Any]:
        return lambda *args, **kwargs: self.run(grid, args, kwargs)

    def run(self, grid, args: tuple, kwargs: dict) -> Any:
        named = {**dict(zip(self.arg_names, args, strict=False)), **kwargs}  # the arguments after args come as kwargs
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
        return cache.get(self._entry(candidates, named, self.tuning_key(named)), candidates)

    def _cache(self) -> TuningCache | None:
        root = default_cache_dir()
        return None if root is None else TuningCache(root)

    def _entry(self, candidates: list[triton.Config], named: dict[str, Any], key: tuple) -> dict[str, Any]:
        device = next(value.device for value in named.values() if isinstance(value, torch.Tensor))
        return TuningCache.entry(self.kernel.__name__, self.source, device_label(device), key, candidates)

    def _choose(self, key: tuple, grid, args: tuple, kwargs: dict, named: dict) -> triton.Config:
        candidates = self.prune(self.configs, named)
        if len(candidates) == 1:
            return candidates[0]
        cache = self._cache()
        if cache is None:
            return self._fastest(candidates, grid, args, kwargs)[0]
        entry = self._entry(candidates, named, key)
        with cache.lock(entry):  # a process that waited here finds the entry the other one stored
            config = cache.get(entry, candidates)
            if config is None:
                config, times = self._fastest(candidates, grid, args, kwargs)
                cache.put(entry, config, times)
        return config

    def _fastest(self, candidates: list[triton.Config], grid, args: tuple, kwargs: dict):
        times = {
            config: self.bench(lambda config=config: self.kernel[grid](*args, **kwargs, **config.all_kwargs()))
            for config in candidates
        }
        return min(times, key=times.get), {str(config): ms for config, ms in times.items()}


AUTOTUNE_ENV = "LM_SYSTEMS_FLASH_AUTOTUNE"


def _configs(candidates: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) tuples → triton.Configs.

    Ordered by preference (benchmarks/results/attention_headline.md lists what tuning chose at the headline
    shapes): with tuning off the first that passes the prune rules runs; the last is small enough for fp32 at
    d = 128 and is the fallback when nothing else fits.
    """
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in candidates]


# Forward and dQ: a program owns BLOCK_M queries and streams K, V in BLOCK_N tiles.
FWD_CONFIGS = _configs(
    [
        (128, 64, 8, 3),
        (128, 64, 8, 4),
        (64, 64, 4, 3),
        (128, 64, 4, 4),
        (128, 128, 8, 3),
        (128, 64, 4, 3),
        (64, 32, 4, 2),
    ]
)
DQ_CONFIGS = _configs(
    [
        (64, 64, 4, 3),
        (64, 64, 4, 4),
        (128, 64, 8, 3),
        (128, 64, 8, 4),
        (128, 64, 4, 3),
        (64, 128, 8, 3),
        (128, 32, 4, 4),
        (128, 32, 4, 5),
        (64, 32, 4, 2),
    ]
)
# dK/dV: a program owns BLOCK_N keys and streams Q, dO in BLOCK_M tiles.
DKDV_CONFIGS = _configs(
    [
        (64, 64, 4, 3),
        (64, 64, 4, 4),
        (128, 64, 8, 3),
        (64, 128, 8, 3),
        (64, 128, 8, 4),
        (32, 128, 4, 3),
        (32, 128, 4, 4),
        (32, 128, 4, 5),
        (32, 64, 4, 4),
        (32, 64, 4, 2),
    ]
)
INTERPRETER_CONFIG = {
    "fwd": triton.Config({"BLOCK_M": 32, "BLOCK_N": 16}, num_warps=4, num_stages=1),
    "dq": triton.Config({"BLOCK_M": 32, "BLOCK_N": 16}, num_warps=4, num_stages=1),
    "dkdv": triton.Config({"BLOCK_M": 16, "BLOCK_N": 32}, num_warps=4, num_stages=1),
}
AUTOTUNE_KEY = ["N_Q_KEY", "N_K_KEY", "HEAD_DIM", "CAUSAL"]
BACKWARD_AUTOTUNE_KEY = [*AUTOTUNE_KEY, "TMA"]  # the tiles loaded through descriptors tune apart


# Fixed when the kernels are defined: triton.jit builds interpreted kernels iff TRITON_INTERPRET=1 then.
_INTERPRETING = isinstance(attn_fwd_kernel, InterpretedFunction)


def interpreting() -> bool:
    """True when the kernels run in Triton's CPU interpreter."""
    return _INTERPRETING


def _fitting(kind: str, configs: list[triton.Config], args: dict) -> list[triton.Config]:
    """The candidates of ``kind`` (fwd / dq / dkdv) that fit the arguments, in order of preference."""
    if interpreting():
        return [INTERPRETER_CONFIG[kind]]
    head_dim_pad = args["HEAD_DIM_PAD"]
    elem_bytes = args["Q"].element_size()
    limit = triton.runtime.driver.active.utils.get_device_properties(args["Q"].device.index)["max_shared_mem"]
    kept = []
    for config in configs:
        bm, bn, warps = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps
        # Tiles longer than the (bucketed) sequence only add masked work.
        if bm > max(args["N_Q_KEY"], 16) or bn > max(args["N_K_KEY"], 16):
            continue
        # Pipelined shared memory: two streamed tiles per stage (K, V or Q, dO) plus two resident ones.
        streamed, resident = (bm, bn) if kind == "dkdv" else (bn, bm)
        if (config.num_stages * 2 * streamed + 2 * resident) * head_dim_pad * elem_bytes > limit:
            continue
        # fp32 registers per thread for the accumulators and score tiles; far past 255 means spills.
        live = {
            "fwd": bm * head_dim_pad + bm * bn,
            "dq": bm * head_dim_pad + 2 * bm * bn,
            "dkdv": 2 * bn * head_dim_pad + 2 * bm * bn,
        }[kind]
        if live / (32 * warps) > 256:
            continue
        kept.append(config)
    # fp32 products run as three tf32 passes, which compile slowly and need more shared memory than
    # the estimate above: fp32 (a correctness path more than a speed path) takes the small last config.
    if elem_bytes == 4 or not kept:
        return configs[-1:]
    return kept[:1] if os.environ.get(AUTOTUNE_ENV, "1") == "0" else kept


def _pruner_for_inductor(kind: str):
    """The prune function of ``kind`` that ``triton.autotune`` calls, under torch.compile from Inductor: the
    choice stored on this machine where there is one (Inductor then times nothing), else what fits."""

    def prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
        args = {**named_args, **kwargs}
        kept = _fitting(kind, configs, args)
        stored = TUNED_FOR_EAGER[kind].stored(kept, args)
        return kept if stored is None else [stored]

    return prune


# What names the kernels' source in a tuning cache entry: an edit to either kernel file tunes again.
KERNEL_SOURCE = fingerprint(
    [Path(module.__file__).read_text() for module in (flash_triton_forward, flash_triton_backward)]
)
_KERNELS = {
    "fwd": (FWD_CONFIGS, attn_fwd_kernel, AUTOTUNE_KEY),
    "dq": (DQ_CONFIGS, attn_bwd_dq_kernel, BACKWARD_AUTOTUNE_KEY),
    "dkdv": (DKDV_CONFIGS, attn_bwd_dkdv_kernel, BACKWARD_AUTOTUNE_KEY),
}
# Eager launches: tuned once per machine (TunedKernel consults the tuning cache itself).
TUNED_FOR_EAGER = {
    kind: TunedKernel(kernel, configs, key, partial(_fitting, kind), KERNEL_SOURCE)
    for kind, (configs, kernel, key) in _KERNELS.items()
}
# Launches from torch.compile's graphs (wrap_triton takes a triton.jit or triton.autotune kernel).
TUNED_FOR_COMPILE = {
    kind: triton.autotune(configs, key=key, prune_configs_by={"early_config_prune": _pruner_for_inductor(kind)})(kernel)
    for kind, (configs, kernel, key) in _KERNELS.items()
}


def tuned_configs() -> dict[str, dict[tuple, str]]:
    """The config each eager kernel chose, per tuning key, so benchmark results can say what ran."""
    return {
        kind: {key: str(config) for key, config in kernel.cache.items()} for kind, kernel in TUNED_FOR_EAGER.items()
    }
