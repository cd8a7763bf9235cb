"""When each unit of a FullyShardedDataParallel gathers, frees and reduce-scatters during a step: the hooks on
the units' modules, the prefetch order, and the queue of reduce-scatters in flight."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from lm_systems.compat.torch import queue_end_of_backward, tree_flatten, tree_unflatten
from lm_systems.parallel.sharded_unit import PendingReduction, ShardedUnit


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs once the unit's backward is done (its weight
    gradients are accumulated first: autograd runs gradient accumulation as soon as it is ready)."""

    @staticmethod
    def forward(ctx, callback, *tensors: torch.Tensor):
        ctx.callback = callback
        return tensors

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.callback()
        return (None, *grads)


class UnitSchedule:
    """The forward and backward hooks of the ``units``: gather before a unit's forward and before its backward,
    free after each, start the next units' all-gathers ``prefetch`` units ahead (in forward, the order of the
    previous forward; in backward, the reverse of this one's), and reduce-scatter a unit's gradients after its
    backward while ``syncing()`` (the container's ``require_backward_grad_sync``)."""

    def __init__(
        self,
        units: list[ShardedUnit],
        compute_dtype: torch.dtype | None,
        prefetch: int,
        syncing: Callable[[], bool],
    ) -> None:
        self.units = units
        self.compute_dtype = compute_dtype
        self.prefetch = prefetch
        self._syncing = syncing
        self._forward_order: list[ShardedUnit] = []  # this forward's units, as they ran
        self._predicted: list[ShardedUnit] = []  # the previous forward's, for prefetching
        self._as_predicted = True  # this forward's units so far ran in the predicted order
        self._awaiting_backward: dict[ShardedUnit, None] = {}
        self._reductions: deque[PendingReduction] = deque()
        self._end_of_backward_queued = False

    # -- forward -----------------------------------------------------------------------------

    def start_forward(self) -> None:
        """Before the wrapped module's forward: this forward predicts the next one's order."""
        for unit in self.units:  # a prefetch the last forward predicted but never used is stale now
            unit.free()
            unit.drop_prefetch()
        if self._forward_order:
            self._predicted, self._forward_order = self._forward_order, []
        self._as_predicted = True

    def pre_forward_hook(self, unit: ShardedUnit):
        def hook(module: nn.Module, args: tuple, kwargs: dict):
            position = len(self._forward_order)
            self._forward_order.append(unit)
            unit.gather()
            predicted = self._predicted
            self._as_predicted = self._as_predicted and position < len(predicted) and predicted[position] is unit
            if self.prefetch and self._as_predicted:
                for ahead in predicted[position + 1 : position + 1 + self.prefetch]:
                    ahead.start_gather()
            plain = not kwargs and all(isinstance(arg, torch.Tensor) for arg in args)  # a block's call: no pytree
            leaves, spec = (list(args), None) if plain else tree_flatten((args, kwargs))
            if self.compute_dtype is not None:
                leaves = [self._cast_input(leaf) for leaf in leaves]
            if torch.is_grad_enabled():
                self._mark_post_backward(unit, leaves)
            return (tuple(leaves), kwargs) if plain else tree_unflatten(leaves, spec)

        return hook

    def _cast_input(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(self.compute_dtype)
        return value

    def _mark_post_backward(self, unit: ShardedUnit, leaves: list) -> None:
        """Route the unit's inputs that need gradients (``leaves``, replaced in place) through ``_PostBackward``."""
        needing = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
        if needing:
            marked = _PostBackward.apply(lambda: self._post_backward(unit), *(leaves[i] for i in needing))
            for i, tensor in zip(needing, marked, strict=True):
                leaves[i] = tensor

    def post_forward_hook(self, unit: ShardedUnit):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            unit.free()
            if not torch.is_grad_enabled():
                return
            leaves = [output] if isinstance(output, torch.Tensor) else tree_flatten(output)[0]
            outputs = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
            for tensor in outputs:
                tensor.register_hook(lambda grad: self._pre_backward(unit))
            if outputs:
                self._awaiting_backward[unit] = None

        return hook

    # -- backward ----------------------------------------------------------------------------

    def _pre_backward(self, unit: ShardedUnit) -> None:
        if not self._end_of_backward_queued:
            queue_end_of_backward(self._end_of_backward)
            self._end_of_backward_queued = True
        unit.gather()
        self._finish_reductions_outweighing(unit)
        order = self._forward_order
        position = len(order) - 1 - order[::-1].index(unit) if unit in order else 0
        for ahead in order[max(0, position - self.prefetch) : position][::-1]:  # the nearest first
            if ahead in self._awaiting_backward:
                ahead.start_gather()

    def _finish_reductions_outweighing(self, unit: ShardedUnit) -> None:
        """A reduce-scatter stays in flight through the next unit's backward, to hide it, as long as its gradients
        weigh no more than that unit's own: the in-flight bytes at most double what the unit's backward holds. A
        heavier one is finished first (on NCCL the device waits for it, not the host): the LM head's, whose gradient
        the fused loss made in forward and whose reduce-scatter would otherwise sit through the last block's
        backward, where the step's memory peaks."""
        while self._reductions and self._reductions[0].unit.grad_numel > unit.grad_numel:
            self._finish_oldest_reduction()

    def _post_backward(self, unit: ShardedUnit) -> None:
        if unit not in self._awaiting_backward:
            return
        del self._awaiting_backward[unit]
        if unit.trainable and self._syncing():
            self._reductions.append(unit.start_reduce_scatter())
            while len(self._reductions) > 1:  # keep one reduce-scatter in flight: bounded memory, still overlapped
                self._finish_oldest_reduction()
        unit.free()

    def _end_of_backward(self) -> None:
        """Autograd's final callback: units whose inputs needed no gradient (the first layer) end here."""
        for unit in reversed(list(self._awaiting_backward)):
            self._post_backward(unit)
        for unit in self.units:
            unit.drop_prefetch()
            unit.free()
        self._end_of_backward_queued = False

    def forget_units(self) -> None:
        """Hold no unit any more (the container unwrapped its module): a later forward or end of backward has none to
        free, and the units, with the process group they hold, go once nothing else holds them."""
        self.units, self._forward_order, self._predicted = [], [], []
        self._awaiting_backward.clear()
        self._reductions.clear()

    def finish_reductions(self) -> None:
        """Wait for the reduce-scatters still in flight; their means land in the shards' ``.grad``."""
        while self._reductions:
            self._finish_oldest_reduction()

    def _finish_oldest_reduction(self) -> None:
        pending = self._reductions.popleft()
        pending.unit.finish_reduce_scatter(pending)
