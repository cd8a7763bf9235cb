"""OwnedGradients: the rank that steps each parameter (a ZeRO-1 optimizer's owner), as a policy an OverlappedDDP is
handed: which gradients this rank clips, and, reducing to owners, where each gradient is sent."""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
import torch.nn as nn

from lm_systems.parallel.collectives import GradientAverager, PendingAverage


class OwnedGradients:
    """Each parameter's owner, ``owner(param)`` (a rank of the default group), and what follows from it.

    Clipping reads and scales only the gradients of the parameters this rank owns, the ranks' squared norms summed (a
    collective): the clip's passes over the gradients are split among the ranks, for an optimizer that steps only
    its own parameters. With ``reduce_to_owner`` each gradient is also reduced to its mean on its owner alone and
    dropped on the other ranks, instead of averaged on every rank: half the bytes of an all-reduce cross the link,
    and each rank keeps only the gradients it steps.
    """

    def __init__(self, owner: Callable[[nn.Parameter], int], reduce_to_owner: bool = True) -> None:
        self._owner = owner
        self.reduce_to_owner = reduce_to_owner
        self._owners: list[list[int]] = []  # per unit, each gradient's owner
        self._group_ranks: list[list[int]] = []  # the same owners as ranks of the gradient group
        self._rank = -1

    def attach(self, units: list[list[nn.Parameter]], group: dist.ProcessGroup, rank: int) -> None:
        """Look the owners of a container's ``units`` up once (``rank``: this one), for its gradient ``group``."""
        self._owners = [[self._owner(p) for p in unit] for unit in units]
        self._group_ranks = [[dist.get_group_rank(group, owner) for owner in unit] for unit in self._owners]
        self._rank = rank

    def owned(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        """The parameters of ``params`` this rank steps: the ones whose gradients it clips."""
        return [p for p in params if self._owner(p) == self._rank]

    def start(self, averager: GradientAverager, grads: list, unit: int) -> PendingAverage:
        """Start the reduction of a unit's gradients to their owners, or their all-reduce."""
        if self.reduce_to_owner:
            return averager.start_to_owners(grads, self._group_ranks[unit])
        return averager.start(grads)

    def settle(self, unit: int, params: list[nn.Parameter]) -> None:
        """After a unit's reduction: the gradients this rank does not own are dropped, if only their owners got
        their means."""
        if not self.reduce_to_owner:
            return
        for param, owner in zip(params, self._owners[unit], strict=True):
            if owner != self._rank:
                param.grad = None
