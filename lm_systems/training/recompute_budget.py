"""``--model.activation_checkpointing auto`` for a run: the memory budget in bytes, what a GPU holds besides the
activations under this run's precision and strategy, and the per-block plan (:mod:`lm_systems.model.memory_budget`).

The state a GPU holds: each parameter, its gradient and AdamW's two moments, all in the parameters' dtype (float32
under ``*-mixed``). zero3 and fsdp2 shard all four over the GPUs (and gather two blocks' parameters at a time in the
activations' dtype); zero1 shards the moments; other strategies over several GPUs keep a second copy of the
gradients in their communication buckets (counted as resident: an upper bound).
"""

from __future__ import annotations

from typing import Optional

import lightning.pytorch as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from lm_systems.model.config import ModelConfig
from lm_systems.model.memory_budget import (
    GIB,
    RECOMPUTE_SHARE_OF_PEAK,
    MemoryNeeds,
    RecomputePlan,
    block_parameter_count,
    parameter_count,
    plan_recompute,
    transient_bytes,
)
from lm_systems.model.recompute import AUTO_WITHOUT_PLAN
from lm_systems.profiling.hardware import peak_flops
from lm_systems.training.out_of_memory import strategy_name

SHARDING_ALL = ("zero3", "fsdp2")
SHARDING_MOMENTS = ("zero1",)


def precision_bytes(precision: str) -> tuple[int, int]:
    """Bytes of a parameter and of an activation under a Lightning precision ("bf16-mixed", "32-true", ...)."""
    bits, _, kind = str(precision).partition("-")
    activation = {"bf16": 2, "16": 2, "32": 4, "64": 8}.get(bits, 4)
    return (4 if kind == "mixed" else activation), activation


def memory_needs(
    config: ModelConfig, batch_size: int, precision: str, strategy: str, world_size: int, accumulate: int = 1
) -> MemoryNeeds:
    """What one GPU of this run holds besides the blocks' kept activations (the module's doc says how), its gradients
    accumulated over ``accumulate`` micro-batches."""
    parameter, activation = precision_bytes(precision)
    count, block = parameter_count(config), block_parameter_count(config)
    end = config.vocab_size * config.d_model * parameter  # the LM head's gradient; the embedding's the same
    transient = transient_bytes(config, batch_size, activation, parameter)
    shards = world_size if world_size > 1 else 1
    if strategy in SHARDING_ALL:
        # 3: the parameters and two moments, a shard each; two blocks' parameters gathered at a time.
        resident = 3 * count * parameter // shards + 2 * block * activation
        return MemoryNeeds(resident, block * parameter // shards, end // shards, transient, accumulate > 1)
    moments = 2 * count * parameter // (shards if strategy in SHARDING_MOMENTS else 1)
    buckets = count * parameter if shards > 1 and strategy not in SHARDING_MOMENTS else 0  # a second gradient copy
    return MemoryNeeds(count * parameter + moments + buckets, block * parameter, end, transient, accumulate > 1)


def eager_recompute_rate(device: torch.device, activation_bytes: int) -> Optional[float]:
    """FLOP/s an eager block's recompute runs at on ``device``: a share of its dense peak for matmuls of the
    activations' width (``profiling.hardware``), None where that peak is not known (the CPU, a GPU not in the table)."""
    dtype = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[activation_bytes]  # fp16's peak is bf16's
    peak = peak_flops(device, dtype)
    return RECOMPUTE_SHARE_OF_PEAK * peak if peak is not None else None


def budget_bytes(memory_budget: float, card_bytes: Optional[int]) -> Optional[int]:
    """``--model.memory_budget`` in bytes: GiB above 1, else a fraction of ``card_bytes`` (None without a card)."""
    if memory_budget > 1:
        return int(memory_budget * GIB)
    return int(memory_budget * card_bytes) if card_bytes is not None else None


def recompute_plan(
    config: ModelConfig, batch_size: Optional[int], trainer: Optional[L.Trainer], compiled: bool
) -> Optional[RecomputePlan]:
    """The plan of ``auto`` for this run (its model ``compiled`` or eager), said in one line; None where the policy is
    not auto or cannot be planned (no trainer or batch: the model keeps ``blocks``'s bytes, as it does without a card
    for a fractional budget)."""
    if config.activation_checkpointing != "auto" or trainer is None or batch_size is None:
        return None
    device = trainer.strategy.root_device
    card = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    budget = budget_bytes(config.memory_budget, card)
    if budget is None:
        rank_zero_info(
            f"activation checkpointing auto: --model.memory_budget {config.memory_budget:g} is a fraction of a card "
            f"and this run has none ({device.type}): every block keeps its input only ({AUTO_WITHOUT_PLAN}); give the "
            "budget in GiB (above 1) to plan for it"
        )
        return None
    strategy, accumulate = strategy_name(trainer.strategy), trainer.accumulate_grad_batches
    needs = memory_needs(config, batch_size, trainer.precision, strategy, trainer.world_size, accumulate)
    parameter, activation = precision_bytes(trainer.precision)
    rate = None if compiled else eager_recompute_rate(device, activation)
    plan = plan_recompute(config, batch_size, activation, budget, needs, parameter, rate)
    rank_zero_info(plan.describe())
    return plan
