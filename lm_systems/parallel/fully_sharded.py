"""FullyShardedDataParallel (ZeRO-3): parameters, gradients and optimizer state sharded over the ranks."""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lm_systems.compat.torch import compiled_whole, foreach_norm, set_module_parameter
from lm_systems.parallel.base import DataParallelModule
from lm_systems.parallel.collectives import GradPresence
from lm_systems.parallel.sharded_unit import ShardedParam, ShardedUnit, shard_rows
from lm_systems.parallel.unit_schedule import UnitSchedule

DEFAULT_UNIT_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Embedding)
"""Every linear or embedding layer outside the units the caller names."""


class FullyShardedDataParallel(DataParallelModule):
    """ZeRO-3 over any module: each unit's parameters split by rows over the ranks, gathered only for its
    forward and its backward, gradients reduce-scattered back into the shards.

    Units are the submodules the caller names in ``units`` (a TransformerLM's blocks, say) and the outermost
    submodules of ``unit_types`` outside them (default: every nn.Linear / nn.Embedding). A unit's parameter of shape
    (rows, *rest) becomes, on rank r, an nn.Parameter of shape (ceil(rows / N), *rest) holding rows r·⌈rows/N⌉
    onwards (the last ranks' padded with zero rows), registered under the same name, so
    ``module.named_parameters()`` are what an optimizer steps and they keep their names, dims and modules
    (weight-decay grouping by module type or ndim still works). Parameters outside the units (norm weights outside
    blocks), scalars, and parameters shared by several units stay whole on every rank, their gradients averaged
    after backward.

    Per unit and step: before its forward, its shards are all-gathered (in ``compute_dtype``, if given,
    which floating inputs are cast to as well) into full leaf parameters the unit computes with; after its
    forward these are freed (storage released, autograd keeps its references); before its backward they
    are gathered again; after it, the full gradients are reduce-scattered (summed; in ``grad_comm_dtype``
    if given, else in the dtype they were computed in) and freed. The next unit's all-gather is started
    ahead of time (in forward, the order of the previous forward; in backward, the reverse of this
    one's), ``prefetch`` units ahead (0: each unit gathers as it starts), and a unit's reduce-scatter is
    waited for only after the next one is launched, so the collectives overlap compute. Deeper prefetch
    holds more gathered units at once and lets a rank's all-gathers wait longer for a slower rank (the hooks
    doing all this are a ``UnitSchedule``'s, in ``unit_schedule.py``).
    ``finish_gradient_synchronization()`` waits for the last ones and writes the mean over ranks into the
    shards' ``.grad`` (master dtype); frozen parameters are sharded and gathered but get no gradients; a
    parameter no rank produced a gradient for keeps ``grad = None``.

    ``no_sync()``: backward passes inside keep the unit's full gradients (in the compute dtype) and
    communicate none, so gradient accumulation costs a full unsharded copy of the gradients on each
    rank (the memory of plain DDP) until the next syncing backward reduce-scatters their sum; the gathers
    themselves still communicate.

    Every rank must run the same units in the same order, forward and backward (as torch FSDP requires);
    a unit may have its forward torch.compiled, not its whole call (its hooks gather and free); the module
    must be on its device before wrapping. The optimizer steps the shards elementwise, so AdamW, Adam and SGD match
    single-process training; an optimizer that takes per-tensor norms (LAMB, Adafactor) sees shards.
    """

    def __init__(
        self,
        module: nn.Module,
        compute_dtype: torch.dtype | None = None,
        units: Iterable[nn.Module] = (),
        unit_types: Iterable[type[nn.Module]] = DEFAULT_UNIT_TYPES,
        process_group: dist.ProcessGroup | None = None,
        grad_comm_dtype: torch.dtype | None = None,
        prefetch: int = 1,
    ) -> None:
        if prefetch < 0:
            raise ValueError(f"prefetch must be 0 (no prefetch) or more units ahead, got {prefetch}")
        super().__init__(module, process_group, grad_comm_dtype)
        self.compute_dtype = compute_dtype
        self.prefetch = prefetch
        unit_modules = _outermost(module, {id(unit) for unit in units}, tuple(unit_types))
        for prefix, unit in unit_modules:
            if compiled_whole(unit):
                raise ValueError(
                    f"unit {prefix or 'the root'} is torch.compiled whole: FullyShardedDataParallel gathers "
                    "and frees its parameters in module hooks, which that would trace; compile its forward "
                    "instead (unit.forward = torch.compile(unit.forward), as TransformerLM.compile_blocks "
                    "does), which leaves the hooks outside the graph"
                )
        self._units = [
            ShardedUnit(unit, prefix, params, process_group, compute_dtype, grad_comm_dtype)
            for (prefix, unit), params in zip(unit_modules, _assign_params(module, unit_modules), strict=True)
            if params
        ]
        self._sharded: dict[int, tuple[ShardedUnit, ShardedParam]] = {
            id(p.shard): (unit, p) for unit in self._units for p in unit.params
        }
        self._replicated = [p for p in module.parameters() if p.requires_grad and id(p) not in self._sharded]
        self._presence = GradPresence(self._replicated, process_group) if self._replicated else None
        self._mesh: DeviceMesh | None = None  # for global_view, made once asked
        container = weakref.ref(self)  # the units' hooks hold the schedule: it must not hold the container
        self._schedule = UnitSchedule(
            self._units, compute_dtype, prefetch, lambda: getattr(container(), "require_backward_grad_sync", False)
        )
        for unit in self._units:
            self._add_hook(
                unit.module.register_forward_pre_hook(self._schedule.pre_forward_hook(unit), with_kwargs=True)
            )
            self._add_hook(unit.module.register_forward_hook(self._schedule.post_forward_hook(unit)))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._require_open()
        self._schedule.start_forward()
        return self.module(*args, **kwargs)

    # -- gradients ---------------------------------------------------------------------------

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        self._schedule.finish_reductions()
        if not self._replicated:
            return
        local = [p.grad is not None for p in self._replicated]
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).float().reshape(-1) for p in self._replicated]
        )
        self._presence.launch(local)
        self._averager.average(flat)
        chunks = flat.split([p.numel() for p in self._replicated])
        for param, chunk, anywhere in zip(self._replicated, chunks, self._presence.wait(), strict=True):
            param.grad = chunk.view_as(param).to(param.dtype) if anywhere else None

    # -- clipping ----------------------------------------------------------------------------

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale every local gradient (shards and replicated) so the global norm is at most ``max_norm``;
        returns the global norm before clipping (a collective; as torch FSDP's ``clip_grad_norm_``)."""
        total = self.grad_norm(norm_type)
        shards = [p.shard for unit in self._units for p in unit.trainable]
        torch.nn.utils.clip_grads_with_norm_(shards + self._replicated, max_norm, total)  # one multi-tensor scale
        return total

    @torch.no_grad()
    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The global norm of the gradients (a collective): the sharded gradients' norms combined over ranks,
        padding rows excluded; replicated gradients, equal on every rank after synchronisation, counted once."""
        norm_type = float(norm_type)
        sharded = [
            p.valid_rows(p.shard.grad, unit.rank)
            for unit in self._units
            for p in unit.trainable
            if p.shard.grad is not None
        ]
        replicated = [p.grad for p in self._replicated if p.grad is not None]
        device = next(self.module.parameters()).device
        local = _total_norm(sharded, norm_type, device)
        if math.isinf(norm_type):
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.process_group)
            return torch.maximum(local, _total_norm(replicated, norm_type, device))
        local.pow_(norm_type)
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=self.process_group)
        return (local + _total_norm(replicated, norm_type, device) ** norm_type) ** (1.0 / norm_type)

    # -- full parameters and state -----------------------------------------------------------

    @torch.no_grad()
    def gather_full_params(self, offload_to_cpu: bool = False) -> dict[str, torch.Tensor]:
        """Every parameter's full value (master dtype) by name, tied names included (a collective; one
        unit gathered at a time, moved to the CPU with ``offload_to_cpu``)."""
        full: dict[str, torch.Tensor] = {}
        for unit in self._units:
            for param, value in zip(unit.params, unit.gather_masters(), strict=True):
                for name in param.names:
                    full[name] = value.cpu() if offload_to_cpu else value
        ordered = {}
        for name, param in self.module.named_parameters(remove_duplicate=False):
            value = full.get(name, param.detach())
            ordered[name] = value.cpu() if offload_to_cpu else value
        return ordered

    def full_state_dict(self) -> dict[str, Any]:
        """The wrapped module's ``state_dict()`` with every shard replaced by the full parameter, on the CPU
        (a collective)."""
        full = self.gather_full_params(offload_to_cpu=True)
        return {name: full.get(name, value) for name, value in self.module.state_dict().items()}

    def load_full_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Load an unsharded state dict of the wrapped module: each rank keeps its rows of each sharded one."""
        converted = dict(state_dict)
        for unit in self._units:
            for param in unit.params:
                for name in param.names:
                    if name in converted:
                        converted[name] = self._shard_of(param, converted[name], name)
        self.module.load_state_dict(converted, strict=strict)

    def _shard_of(self, param: ShardedParam, full: torch.Tensor, name: str) -> torch.Tensor:
        if full.shape != param.shape:
            raise ValueError(
                f"{name}: the state holds shape {tuple(full.shape)}, the model {tuple(param.shape)}: "
                "it belongs to a different model"
            )
        return shard_rows(full, self.rank, self.world_size)

    def full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``optimizer``'s state dict as the same optimizer over the unsharded parameters would hold it, on
        the CPU (a collective: every rank calls it). State tensors of a shard's shape are gathered whole;
        others (AdamW's ``step``) are the same on every rank and kept."""
        saved = optimizer.state_dict()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        state = {}
        for index, values in saved["state"].items():
            owner = self._sharded.get(id(params[index]))
            state[index] = {
                key: _to_cpu(
                    owner[0].gather_like(owner[1], value)
                    if owner and isinstance(value, torch.Tensor) and value.shape == params[index].shape
                    else value
                )
                for key, value in values.items()
            }
        return {"state": state, "param_groups": saved["param_groups"]}

    def load_full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        """Load an unsharded state dict of ``optimizer``'s class (from ``full_optimizer_state_dict``, or from
        training without sharding, at any world size): this rank keeps its rows."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        state = {}
        for index, values in state_dict["state"].items():
            owner = self._sharded.get(id(params[index]))
            state[index] = {
                key: self._shard_of(owner[1], value, f"optimizer state {key!r} of parameter {index}")
                if owner and isinstance(value, torch.Tensor) and value.shape == owner[1].shape
                else value
                for key, value in values.items()
            }
        optimizer.load_state_dict({"state": state, "param_groups": state_dict["param_groups"]})

    # -- sharded values (checkpoints written by every rank) ------------------------------------

    def global_view(self, param: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, shaped like this rank's shard ``param`` (the parameter or an optimizer state of it), as a DTensor
        of the full parameter's shape over the rows this rank holds (padding excluded; a view, so writing into it
        writes ``tensor``); any other tensor as it is. Rows are split as DTensor's ``Shard(0)`` splits them."""
        found = self._sharded.get(id(param))
        if found is None or tensor.shape != param.shape:
            return tensor
        unit, sharded = found
        if self._mesh is None:
            group = self.process_group if self.process_group is not None else dist.group.WORLD
            self._mesh = DeviceMesh.from_group(group, tensor.device.type)
        rows = sharded.valid_rows(tensor, unit.rank)
        stride = torch.empty(sharded.shape, device="meta").stride()
        return DTensor.from_local(rows, self._mesh, [Shard(0)], run_check=False, shape=sharded.shape, stride=stride)

    def full_shape(self, param: torch.Tensor) -> torch.Size:
        """The shape of the parameter of which ``param`` is this rank's shard (``param``'s own if it is not one)."""
        found = self._sharded.get(id(param))
        return found[1].shape if found is not None else param.shape

    # -- teardown ----------------------------------------------------------------------------

    @torch.no_grad()
    def remove_hooks(self) -> None:
        """Remove the hooks and give the module its full parameters back (a collective; gradients dropped)."""
        super().remove_hooks()
        for unit in self._units:
            unit.drop_prefetch()
            unit.free()
            for param, value in zip(unit.params, unit.gather_masters(), strict=True):
                restored = nn.Parameter(value, requires_grad=param.shard.requires_grad)
                for module, name in param.slots:
                    set_module_parameter(module, name, restored)
        self._units, self._sharded = [], {}
        self._schedule.forget_units()
        self._replicated = [p for p in self.module.parameters() if p.requires_grad]
        self._presence = GradPresence(self._replicated, self.process_group) if self._replicated else None

    def close(self) -> None:
        """``remove_hooks`` (a collective: the module gets its full parameters back), then drop the process group."""
        super().close()
        self._presence = None


def _outermost(
    module: nn.Module, named: set[int], unit_types: tuple[type[nn.Module], ...]
) -> list[tuple[str, nn.Module]]:
    """The submodules named (by id) or of ``unit_types`` not inside another such submodule, in registration order."""
    units: list[tuple[str, nn.Module]] = []
    for name, sub in module.named_modules():
        inside = any(prefix == "" or name.startswith(prefix + ".") for prefix, _ in units)
        if (id(sub) in named or isinstance(sub, unit_types)) and not inside:
            units.append((name, sub))
    return units


def _assign_params(module: nn.Module, units: list[tuple[str, nn.Module]]):
    """Per unit, its parameters to shard as (parameter, [(owning module, attribute)], [qualified names]):
    those with at least one dim held inside exactly that unit; the rest stay replicated."""
    homes: dict[int, set[str | None]] = {}
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    names: dict[int, list[str]] = {}
    first_seen: dict[int, nn.Parameter] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        owner, _, attr = name.rpartition(".")
        home = next((prefix for prefix, _ in units if prefix == "" or name.startswith(prefix + ".")), None)
        homes.setdefault(id(param), set()).add(home)
        slots.setdefault(id(param), []).append((module.get_submodule(owner), attr))
        names.setdefault(id(param), []).append(name)
        first_seen.setdefault(id(param), param)
    per_unit = []
    for prefix, _ in units:
        per_unit.append(
            [(p, slots[key], names[key]) for key, p in first_seen.items() if homes[key] == {prefix} and p.ndim >= 1]
        )
    return per_unit


def _total_norm(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch.stack(foreach_norm(grads, norm_type, dtype=torch.float32))  # multi-tensor kernels, not one a grad
    return torch.linalg.vector_norm(norms, norm_type).to(device)


def _to_cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value
