"""Autotuned FlashAttention-2 kernels: the tile-size / warp / stage candidates and the prune function.

Each kernel is tuned per (query-length bucket, key-length bucket, head dim, causal, dtypes). The
buckets are the next power of two, so a training run with a fixed context tunes once and odd lengths
share the tuning of their bucket. fp16 and bf16 are tuned; fp32 always takes the small last config.
Eager calls tune through ``TunedKernel``, which keeps each choice on disk (``TuningCache``): a shape is
tuned once per machine, not once per process. Under torch.compile Inductor tunes the ``triton.autotune``
kernels over the same candidates, or takes the stored choice where there is one.
Set ``LM_SYSTEMS_FLASH_AUTOTUNE=0`` to skip tuning and take each kernel's first candidate that fits
(useful for tests over many shapes, where compiling every candidate costs more than the tests). Under ``TRITON_INTERPRET=1`` one small config is used: the interpreter runs
on the CPU, where timing candidates means nothing, and small unequal tiles exercise the tile logic
(several query and key tiles, diagonal tiles, ragged ends) at the tiny test sizes.
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import triton
from triton.runtime.interpreter import InterpretedFunction

from lm_systems.attention import flash_triton_backward, flash_triton_forward
from lm_systems.attention.flash_triton_backward import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel
from lm_systems.attention.flash_triton_forward import attn_fwd_kernel
from lm_systems.attention.tuned_kernel import TunedKernel
from lm_systems.fingerprint import fingerprint

AUTOTUNE_ENV = "LM_SYSTEMS_FLASH_AUTOTUNE"


def _configs(candidates: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) tuples → triton.Configs.

    Ordered by preference (the first is the best at the headline shape on an H100): with tuning off
    the first that passes the prune rules runs; the last is small enough for fp32 at d = 128 and is
    the fallback when nothing else fits.
    """
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in candidates
    ]


# Forward and dQ: a program owns BLOCK_M queries and streams K, V in BLOCK_N tiles.
FWD_CONFIGS = _configs([
    (128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3), (128, 64, 4, 4), (128, 128, 8, 3), (128, 64, 4, 3),
    (64, 32, 4, 2),
])
DQ_CONFIGS = _configs([
    (64, 64, 4, 3), (64, 64, 4, 4), (128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 4, 3), (64, 128, 8, 3),
    (128, 32, 4, 4), (128, 32, 4, 5), (64, 32, 4, 2),
])
# dK/dV: a program owns BLOCK_N keys and streams Q, dO in BLOCK_M tiles.
DKDV_CONFIGS = _configs([
    (64, 64, 4, 3), (64, 64, 4, 4), (128, 64, 8, 3), (64, 128, 8, 3), (64, 128, 8, 4), (32, 128, 4, 3),
    (32, 128, 4, 4), (32, 128, 4, 5), (32, 64, 4, 4), (32, 64, 4, 2),
])
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
        live = {"fwd": bm * head_dim_pad + bm * bn, "dq": bm * head_dim_pad + 2 * bm * bn,
                "dkdv": 2 * bn * head_dim_pad + 2 * bm * bn}[kind]
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
        stored = TUNED[kind].stored(kept, args)
        return kept if stored is None else [stored]

    return prune


# What names the kernels' source in a tuning cache entry: an edit to either kernel file tunes again.
KERNEL_SOURCE = fingerprint([Path(module.__file__).read_text() for module in (flash_triton_forward,
                                                                              flash_triton_backward)])
_KERNELS = {"fwd": (FWD_CONFIGS, attn_fwd_kernel, AUTOTUNE_KEY),
            "dq": (DQ_CONFIGS, attn_bwd_dq_kernel, BACKWARD_AUTOTUNE_KEY),
            "dkdv": (DKDV_CONFIGS, attn_bwd_dkdv_kernel, BACKWARD_AUTOTUNE_KEY)}
# Eager launches: tuned once per machine (TunedKernel consults the tuning cache itself).
TUNED = {kind: TunedKernel(kernel, configs, key, partial(_fitting, kind), KERNEL_SOURCE)
         for kind, (configs, kernel, key) in _KERNELS.items()}
# Launches from torch.compile's graphs (wrap_triton takes a triton.jit or triton.autotune kernel).
AUTOTUNED = {kind: triton.autotune(configs, key=key,
                                   prune_configs_by={"early_config_prune": _pruner_for_inductor(kind)})(kernel)
             for kind, (configs, kernel, key) in _KERNELS.items()}


def tuned_configs() -> dict[str, dict[tuple, str]]:
    """The config each eager kernel chose, per tuning key, so benchmark results can say what ran."""
    return {kind: {key: str(config) for key, config in kernel.cache.items()} for kind, kernel in TUNED.items()}
