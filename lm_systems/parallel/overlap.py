"""Overlapping gradient communication with backward: the shared launch logic, and one all-reduce per parameter."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn

from lm_systems.parallel.base import DataParallelModule
from lm_systems.parallel.collectives import GradPresence, PendingAverage
from lm_systems.parallel.launch_thread import LaunchThread
from lm_systems.parallel.owned_gradients import OwnedGradients


class OverlappedDDP(DataParallelModule):
    """Averages gradients in *units* (a parameter, or a bucket of them) launched during backward.

    A unit's async all-reduce starts once every parameter in it has its gradient accumulated
    (``register_post_accumulate_grad_hook``). Units launch strictly in index order, so every rank issues
    the same sequence of collectives even when gradients arrive in different orders or a parameter is
    unused on one rank; a unit that is ready early waits for the ones before it. Units never launched
    during backward (unused parameters, ``no_sync``) are launched by ``finish_gradient_synchronization``.
    With ``launch_thread`` the launches run on a ``LaunchThread`` instead of in the hooks on autograd's
    thread, which then only queue them. Handed an :class:`OwnedGradients` (``assign_owners``), it clips only the
    gradients this rank's optimizer steps, and may send each gradient only to the rank that steps its parameter
    (ZeRO-1's owner) instead of to every rank.
    """

    def __init__(
        self,
        module: nn.Module,
        units: list[list[nn.Parameter]],
        process_group: dist.ProcessGroup | None = None,
        grad_comm_dtype: torch.dtype | None = None,
        launch_thread: bool = False,
    ) -> None:
        super().__init__(module, process_group, grad_comm_dtype)
        self._units = units
        device = units[0][0].device if units else torch.device("cpu")
        self._launcher = LaunchThread(device) if launch_thread else None
        # Stops the thread when the container is closed or, left unclosed, freed.
        self._stop_launcher = weakref.finalize(self, self._launcher.close) if launch_thread else None
        self._params = [p for unit in units for p in unit]
        self._names = {id(p): name for name, p in module.named_parameters()}
        self._presence = GradPresence(self._params, process_group)
        self._works: list[PendingAverage | None] = [None] * len(units)
        self._waiting = [len(unit) for unit in units]  # gradients still to arrive, per unit, this backward
        self._arrived = [False] * len(self._params)  # per parameter: accumulated in this syncing backward
        self._got_grad = [False] * len(self._params)  # per parameter: accumulated since the last synchronisation
        self._next_unit = 0
        self._zeros: dict[tuple[int, int], torch.Tensor] = {}  # (unit, index): sent for a gradient this rank lacks
        self._owners: OwnedGradients | None = None  # assign_owners
        self._clipped: list[nn.Parameter] | None = None  # what clip_grad_norm_ reads and scales, once owners are known
        flat_index = 0
        for u, unit in enumerate(units):
            for param in unit:
                hook = self._weak_hook(self._on_grad_accumulated, u, flat_index)
                self._add_hook(param.register_post_accumulate_grad_hook(hook))
                flat_index += 1

    def assign_owners(self, owners: OwnedGradients) -> None:
        """From the next synchronisation on, clip (and, reducing to owners, send) gradients as ``owners`` says."""
        owners.attach(self._units, self._averager.group, self.rank)
        self._owners = owners
        self._clipped = owners.owned(self._params)

    @property
    def units(self) -> list[list[nn.Parameter]]:
        """The parameters of each unit (averaged together), in launch order."""
        return self._units

    # -- the gradients of a unit -------------------------------------------------------------

    def _local_presence(self) -> list[bool]:
        """Per parameter (in unit order): does this rank hold a gradient for it?"""
        return [p.grad is not None for p in self._params]

    def _launch(self, unit: int) -> PendingAverage:
        """Start the averaging all-reduce of a unit's gradients, in place: autograd's own tensors, no copies
        (a parameter without one on this rank sends the zeros ``_prepare_late`` made)."""
        grads = [p.grad if p.grad is not None else self._zeros[(unit, i)] for i, p in enumerate(self._units[unit])]
        if self._owners is not None:
            return self._owners.start(self._averager, grads, unit)
        return self._averager.start(grads)

    def _prepare_late(self, unit: int) -> None:
        """Before a launch from ``finish``: zeros where a parameter has no gradient on this rank."""
        for index, param in enumerate(self._units[unit]):
            if param.grad is None:
                self._zeros[(unit, index)] = torch.zeros_like(param)

    # -- launching ---------------------------------------------------------------------------

    def _on_grad_accumulated(self, unit: int, flat_index: int, param: nn.Parameter) -> None:
        # Runs on autograd's thread between backward's kernel launches, once per parameter: kept lean
        # (a torch.no_grad decorator alone would double its cost).
        self._got_grad[flat_index] = True
        if not self.require_backward_grad_sync:
            return
        if unit < self._next_unit or self._arrived[flat_index]:
            raise RuntimeError(
                f"the gradient of {self._names.get(id(param), 'a parameter')!r} arrived after its all-reduce "
                "was launched: call finish_gradient_synchronization() after every backward, and run "
                "accumulation micro-batches inside no_sync()"
            )
        self._arrived[flat_index] = True
        self._waiting[unit] -= 1
        if self._waiting[unit] == 0:
            self._launch_ready_units()

    def _launch_ready_units(self) -> None:
        while self._next_unit < len(self._units) and self._waiting[self._next_unit] == 0:
            if self._launcher is None:
                self._launch_into_works(self._next_unit)
            else:
                self._launcher.submit(partial(self._launch_into_works, self._next_unit))
            self._next_unit += 1

    def _launch_into_works(self, unit: int) -> None:
        self._works[unit] = self._launch(unit)

    def finish_gradient_synchronization(self) -> None:
        for _ in self.averaged_units():
            pass

    @torch.no_grad()
    def averaged_units(self) -> Iterator[int]:
        """``finish_gradient_synchronization`` unit by unit: yields each unit's index, in launch order, once
        its mean is in ``.grad`` (on CUDA: once the current stream waits for it), so that work issued between
        yields, like an optimizer step over that unit's parameters, overlaps the averaging of the units
        after it. Consume it to the end: the last step resets the container for the next backward.
        """
        if self._launcher is not None:
            self._launcher.drain()
        local = self._local_presence()
        for unit in range(self._next_unit, len(self._units)):
            self._prepare_late(unit)
            self._works[unit] = self._launch(unit)
        self._presence.launch(local)
        # Which parameters keep ``grad = None`` is known without the presence all-reduce when this rank
        # holds every gradient; otherwise read it first (a host sync), before any unit is handed out.
        holds_every_gradient = all(local)
        if not holds_every_gradient:
            self._settle_presence(self._presence.wait())
        for unit, work in enumerate(self._works):
            work.wait()
            if self._owners is not None:
                self._owners.settle(unit, self._units[unit])
            yield unit
        if holds_every_gradient:
            self._presence.wait()
        self._reset()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the synchronised gradients to a global 2-norm of at most ``max_norm``; the norm before clipping.
        Once owners are assigned, only the gradients of this rank's own parameters are scaled."""
        total = self.grad_norm()
        clipped = self._params if self._clipped is None else self._clipped
        torch.nn.utils.clip_grads_with_norm_(clipped, max_norm, total)  # scales each .grad there is
        return total

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """The global 2-norm of the synchronised gradients. Once owners are assigned, each rank takes its own
        parameters' gradients and their squared norms are summed over ranks (a collective)."""
        owned = self._clipped is not None
        grads = [p.grad for p in (self._clipped if owned else self._params) if p.grad is not None]
        local = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=self._params[0].device)
        if not owned:
            return local
        squared = local.float().square()
        dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=self.process_group)
        return squared.sqrt()

    def _settle_presence(self, anywhere: list[bool]) -> None:
        present = iter(anywhere)
        for u, unit in enumerate(self._units):
            for i, param in enumerate(unit):
                if not next(present):
                    param.grad = None  # no rank produced one: as single-process training leaves it
                elif param.grad is None:
                    param.grad = self._zeros.pop((u, i))  # averaged in place by the unit's wait

    def remove_hooks(self) -> None:
        """Detach the container from its parameters' hooks and stop its launch thread (after the launches queued)."""
        super().remove_hooks()
        if self._stop_launcher is not None:
            self._stop_launcher()

    def close(self) -> None:
        super().close()
        self._presence = None
        self._works = [None] * len(self._units)

    def _reset(self) -> None:
        self._works = [None] * len(self._units)
        self._waiting = [len(unit) for unit in self._units]
        self._arrived = [False] * len(self._params)
        self._got_grad = [False] * len(self._params)
        self._next_unit = 0
        self._zeros.clear()


class PerParameterDDP(OverlappedDDP):
    """Launches an async all-reduce of each gradient, in place in ``.grad``, as soon as it is accumulated."""

    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | None = None,
        grad_comm_dtype: torch.dtype | None = None,
        launch_thread: bool = False,
    ) -> None:
        params = [p for p in module.parameters() if p.requires_grad]
        # Reverse registration order: roughly the order backward produces gradients in.
        super().__init__(module, [[p] for p in reversed(params)], process_group, grad_comm_dtype, launch_thread)
