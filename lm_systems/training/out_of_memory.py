"""CUDA out of memory in a training step, in validation or in the optimizer's step, as one line: where it happened (and
on which rank), the peak, the card's size and what to change in this run's terms.

``named_out_of_memory`` turns torch's ``OutOfMemoryError`` into ``OutOfMemory``, a ``RunError``: the run ends with
that line and exit status 1 (:mod:`lm_systems.errors`), as a non-finite loss does. Where the weights are whole (the
forward, backward, validation), ``crash.ckpt`` is written with the same advice, since resuming with the same settings
runs out again; an optimizer's step stopped midway may have updated some weights and not others, so none is written
then and the last checkpoint written stays the one to resume from.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Optional

import torch

from lm_systems.errors import RunError

GIB = 2**30
MORE_FRUGAL = {
    "none": "keep_projections",
    "selective": "keep_projections",
    "keep_projections": "keep_attention",
    "keep_attention": "blocks",
    "auto": "blocks",
}
"""Each ``--model.activation_checkpointing`` policy's next one that keeps less for backward (and recomputes more)."""
SHARDING_STRATEGIES = ("zero3", "fsdp2")
"""Strategies that shard parameters, gradients and optimizer state over the GPUs."""


@dataclass(frozen=True)
class RunTerms:
    """What of a run an out-of-memory message names: the settings a person changes to fit, and where it ran."""

    batch_size: Optional[int]
    context_length: int
    activation_checkpointing: str
    memory_budget: float
    strategy: str  # the strategy's registered name where it has one, else its class name
    rank: int
    world_size: int
    step: int


def what_to_change(terms: RunTerms, gpus: int) -> str:
    """The changes that make this run need less memory, named as flags with their values now; ``gpus``: the CUDA
    devices on this host (a sharding strategy is offered where there are several)."""
    batch = f" (now {terms.batch_size})" if terms.batch_size is not None else ""
    changes = [f"a smaller --data.batch_size{batch} or --model.context_length (now {terms.context_length})"]
    if terms.activation_checkpointing == "auto":
        changes.append(f"a lower --model.memory_budget (now {terms.memory_budget:g})")
    frugal = MORE_FRUGAL.get(terms.activation_checkpointing)
    if frugal is not None:
        changes.append(f"--model.activation_checkpointing {frugal} (now {terms.activation_checkpointing})")
    if gpus > 1 and terms.strategy not in SHARDING_STRATEGIES:
        changes.append(
            f"--trainer.strategy zero3 --trainer.devices {gpus} (now {terms.strategy} on {terms.world_size}), which "
            "shards parameters, gradients and optimizer state"
        )
    return "change one of: " + "; ".join(changes)


def memory_reading(device: torch.device) -> str:
    """The allocator's peak on ``device`` since the last reset and the card's size, or why there is none."""
    if device.type != "cuda":
        return f"no CUDA memory statistics on {device.type}"
    allocated, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    total = torch.cuda.get_device_properties(device).total_memory
    return (
        f"peak {allocated / GIB:.1f} GiB allocated, {reserved / GIB:.1f} GiB reserved, of the card's "
        f"{total / GIB:.1f} GiB"
    )


class OutOfMemory(RunError):
    """CUDA ran out of memory; the message says where, the peak, the card and what to change."""

    def __init__(self, where: str, terms: RunTerms, reading: str, advice: str, weights_whole: bool) -> None:
        rank = f" on rank {terms.rank} of {terms.world_size}" if terms.world_size > 1 else ""
        kept = "" if weights_whole else " (no checkpoint of weights an unfinished update may have changed is written)"
        super().__init__(
            f"CUDA out of memory in {where}{rank} at step {terms.step}: {reading}; {advice}{kept} "
            "(--debug true shows the traceback)"
        )
        self.resume_advice = advice if weights_whole else None


@contextlib.contextmanager
def named_out_of_memory(
    where: str, terms: Callable[[], RunTerms], device: Callable[[], torch.device], weights_whole: bool = True
) -> Iterator[None]:
    """Run the block; torch's out-of-memory inside it raises ``OutOfMemory`` saying ``where`` (an ``OutOfMemory``
    from a block inside passes as it is)."""
    try:
        yield
    except torch.OutOfMemoryError as error:
        run, on = terms(), device()
        gpus = torch.cuda.device_count() if on.type == "cuda" else 0
        raise OutOfMemory(where, run, memory_reading(on), what_to_change(run, gpus), weights_whole) from error


def strategy_name(strategy: object) -> str:
    """The name a strategy is registered under where its class states one (``--trainer.strategy``), else its class's."""
    return getattr(type(strategy), "strategy_name", type(strategy).__name__)
