"""What a training strategy and the LightningModule offer each other, as small typed protocols, and the names the
strategies share: strategies implement (or call) the protocols, and lm_systems checks for them with ``isinstance`` (it
never imports the strategies)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import nn

COMM_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""The dtypes a strategy's option may name for communication or compute (``grad_comm_dtype``, ``compute_dtype``)."""


@runtime_checkable
class GlobalGradNorm(Protocol):
    """The norm of the synchronised gradients over every rank's share of them, and clipping by it: one collective
    where ranks hold different gradients (a shard each, or only the parameters they step)."""

    def grad_norm(self) -> torch.Tensor:
        """The global 2-norm of the gradients."""

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients to a global 2-norm of at most ``max_norm``; the norm before clipping."""


class LocalGradNorm:
    """torch's norm and clipping over ``parameters``: the global one where every rank holds the whole gradients (one
    process, DDP after its all-reduce) or they are DTensors, which torch combines over the ranks (FSDP2)."""

    def __init__(self, parameters: Iterable[nn.Parameter]) -> None:
        self._parameters = list(parameters)

    def grad_norm(self) -> torch.Tensor:
        return torch.nn.utils.get_total_norm([p.grad for p in self._parameters if p.grad is not None])

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self._parameters, max_norm)


@runtime_checkable
class BlockRuns(Protocol):
    """What ``--model.compile buckets`` needs of a bucketing strategy: which consecutive blocks' gradients land in
    one bucket of the container it will wrap the module in."""

    def block_runs(self, module: nn.Module, blocks: Sequence[nn.Module]) -> list[int]:
        """The runs of consecutive ``blocks`` whose gradients share a bucket, as sizes (summing to ``len(blocks)``)."""


@runtime_checkable
class ShardingUnits(Protocol):
    """What a sharding strategy needs of the LightningModule: what to shard one by one."""

    def sharding_units(self) -> tuple[nn.Module, Sequence[nn.Module]]:
        """The module each step's forward runs, and the submodules inside it to shard one by one (each block)."""


@runtime_checkable
class StoppedTogether(Protocol):
    """What a crash save of a run of several processes needs of its strategy: that every rank stopped at the same
    batch, between optimizer steps, so that the save's collectives meet (a SIGTERM the ranks agreed on)."""

    def stopped_together(self) -> bool:
        """Whether the ranks agreed to stop, each at the same batch boundary."""
