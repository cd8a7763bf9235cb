"""How LitLM torch.compiles its TransformerLM: whole, per block, or per run of blocks whose gradients share a bucket."""

from __future__ import annotations

from typing import Literal, Optional, Union

import lightning.pytorch as L
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.utilities import rank_zero_info

from lm_systems.errors import InputError
from lm_systems.model.transformer import TransformerLM
from lm_systems.training.strategy_offers import BlockRuns

CompileChoice = Union[bool, Literal["blocks", "model", "buckets"]]


def bucketing_strategies() -> list[str]:
    """The registered strategy names whose strategies offer ``BlockRuns``."""
    return [name for name, entry in StrategyRegistry.items() if issubclass(entry["strategy"], BlockRuns)]


def compile_model(
    model: TransformerLM, choice: CompileChoice, trainer: Optional[L.Trainer], module: L.LightningModule
) -> None:
    """Per block under a data-parallel strategy, on any number of processes: its container's hooks (a gradient's
    reduction as its block's backward ends, zero3's gather before a block's forward) stay outside the graphs; else
    the whole model, whose one graph launches its kernels with less host work per step (unless ``choice`` names one
    of the two). "buckets": per run of blocks that the strategy's ``block_runs`` gives for ``module``, which it
    will wrap."""
    wrapped = trainer is not None and isinstance(trainer.strategy, ParallelStrategy)
    if choice == "buckets":
        strategy = trainer.strategy if trainer is not None else None
        if not isinstance(strategy, BlockRuns):
            name = type(strategy).__name__ if strategy is not None else "no trainer"
            raise InputError(
                f"--model.compile buckets compiles the blocks whose gradients share a bucket as one "
                f"graph: it needs a bucketing strategy (--strategy {' or '.join(bucketing_strategies())}), got "
                f"{name}; use --model.compile true"
            )
        runs = strategy.block_runs(module, model.blocks)
        model.compile_blocks(runs=runs)
        rank_zero_info(
            f"--model.compile buckets: the {len(model.blocks)} blocks compiled in {len(runs)} runs "
            f"of {', '.join(map(str, runs))} (one graph a run, whose gradients share a bucket)"
        )
    elif choice == "blocks" or (choice is True and wrapped):
        model.compile_blocks()
    else:
        model.compile()
