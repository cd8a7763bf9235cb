"""One unit of fully sharded data parallelism: its parameters split by rows over the ranks, gathered whole
for compute and freed after, its gradients reduce-scattered back into the shards.

A unit's collectives are grouped per parameter (one NCCL launch for the unit), so nothing is copied around
them: every rank's shards are gathered straight into the storage of the full parameters, and the full
gradients autograd made are reduce-scattered as they are, into views of one flat buffer that become the
shards' gradients."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from lm_systems.compat.torch import foreach_copy_, set_module_parameter

# torch 2.13 renamed the flat collectives (the old names warn as deprecated); older releases have only those.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_gather_params(outputs: list[torch.Tensor], inputs: list[torch.Tensor], group: dist.ProcessGroup) -> dist.Work:
    """Every rank's ``inputs[i]`` into ``outputs[i]``, rank after rank: one grouped launch for the list."""
    return group.allgather_into_tensor_coalesced(outputs, inputs)


def _reduce_scatter_grads(
    outputs: list[torch.Tensor], inputs: list[torch.Tensor], group: dist.ProcessGroup, op: dist.ReduceOp
) -> dist.Work:
    """Rank r's ``outputs[i]`` = ``op`` over ranks of chunk r of ``inputs[i]``: one grouped launch for the list."""
    options = dist.ReduceScatterOptions()
    options.reduceOp = op
    return group.reduce_scatter_tensor_coalesced(outputs, inputs, options)


def rows_per_rank(rows: int, world_size: int) -> int:
    """Rows of dim 0 each rank holds: the last rank's share is padded with zero rows up to this."""
    return -(-rows // world_size)


def gather_rows(grid: torch.Tensor, full: torch.Tensor) -> None:
    """``full`` (rows, *rest) from ``grid`` (N, rows_per_rank, *rest), rank r's rows from grid[r] (padding dropped)."""
    per_rank = grid.shape[1]
    whole, rest = divmod(full.shape[0], per_rank)
    full[: whole * per_rank].view(whole, per_rank, *full.shape[1:]).copy_(grid[:whole])
    if rest:
        full[whole * per_rank :].copy_(grid[whole, :rest])


def shard_rows(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s rows of ``full``, zero-padded to ``rows_per_rank`` rows (a new tensor)."""
    per_rank = rows_per_rank(full.shape[0], world_size)
    shard = full.new_zeros(per_rank, *full.shape[1:])
    mine = full[rank * per_rank : (rank + 1) * per_rank]
    shard[: mine.shape[0]].copy_(mine)
    return shard


@dataclass
class ShardedParam:
    """A parameter of a unit: ``shard`` (the master rows this rank steps, an nn.Parameter the module holds
    between uses) and ``full`` (the gathered whole in the compute dtype, a leaf whose storage is freed
    while the unit is sharded, and sized while gathered for every rank's shard, the last ones' padding
    rows included). ``slots`` are the (module, attribute) places that hold it, ``names`` its qualified
    names below the wrapped module."""

    shard: nn.Parameter
    full: nn.Parameter
    shape: torch.Size
    slots: list[tuple[nn.Module, str]]
    names: list[str]
    flat: torch.Tensor  # the full parameter's storage as one flat tensor for every rank's shard, in rank order
    storage: torch.UntypedStorage  # the full parameter's, resized to gather and to release
    offset: int = 0  # in the unit's flat shard (gather_masters' layout)
    _flat_shard: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def create(
        cls,
        original: torch.Tensor,
        shard: nn.Parameter,
        dtype: torch.dtype,
        world_size: int,
        slots: list[tuple[nn.Module, str]],
        names: list[str],
        offset: int,
    ) -> "ShardedParam":
        """The full parameter made once, its storage released; ``flat`` is made while it is allocated (a view
        follows its storage through every later release and allocation, so no gather makes a new one). Through
        ``.data``: refilling a leaf that autograd saved for backward must not bump its version."""
        full = nn.Parameter(
            torch.empty(original.shape, dtype=dtype, device=original.device), requires_grad=original.requires_grad
        )
        size = shard.numel() * world_size
        storage = full.untyped_storage()
        storage.resize_(size * full.element_size())
        flat = full.data.as_strided((size,), (1,))
        storage.resize_(0)
        return cls(shard, full, original.shape, slots, names, flat, storage, offset)

    @property
    def numel(self) -> int:
        return self.shard.numel()

    def flat_shard(self) -> torch.Tensor:
        """The shard's values as one flat view, made once: again only if the shard's data was replaced (a new
        storage, so a new address; the old one is held by the view and cannot be reused meanwhile)."""
        if self._flat_shard is None or self._flat_shard.data_ptr() != self.shard.data_ptr():
            self._flat_shard = self.shard.detach().view(-1)
        return self._flat_shard

    def allocate(self) -> torch.Tensor:
        """Give the full parameter its storage back; returns ``flat``, which the all-gather fills."""
        self.storage.resize_(self.flat.nbytes)
        return self.flat

    def release(self) -> None:
        self.storage.resize_(0)

    def valid_rows(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """The rows of a shard-shaped ``tensor`` that hold real rows of the parameter (padding excluded)."""
        per_rank = self.shard.shape[0]
        return tensor[: max(0, min(per_rank, self.shape[0] - rank * per_rank))]


@dataclass
class PendingReduction:
    """An in-flight reduce-scatter of one unit's gradients: ``sent`` are its inputs (kept alive until it
    completes), ``output`` the flat buffer whose views become the shards' gradients."""

    unit: "ShardedUnit"
    sent: list[torch.Tensor]
    output: torch.Tensor
    work: dist.Work
    local_present: list[bool] = field(default_factory=list)


class ShardedUnit:
    """The parameters of one submodule (a Transformer block, a layer), sharded by rows over the ranks.

    Gathering: one all-gather per parameter, grouped into one launch, each into the full parameter's own
    storage (rank r's rows land where they belong; no copy out). Gradients: one reduce-scatter per
    trainable parameter of its full gradient (as autograd made it, unless it needs a cast or padding),
    grouped into one launch with a last one of presence flags, so each rank learns, with its averaged
    shard, which parameters got a gradient on any rank. The outputs are views of one flat buffer.
    """

    def __init__(
        self,
        module: nn.Module,
        prefix: str,
        params: list[tuple[nn.Parameter, list[tuple[nn.Module, str]], list[str]]],
        group: dist.ProcessGroup | None,
        compute_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
    ) -> None:
        self.module = module
        self.prefix = prefix
        self.group = group if group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.params: list[ShardedParam] = []
        self.trainable: list[ShardedParam] = []
        offset = 0
        for original, slots, names in params:
            shard = nn.Parameter(
                shard_rows(original.detach(), self.rank, self.world_size), requires_grad=original.requires_grad
            )
            param = ShardedParam.create(
                original, shard, compute_dtype or original.dtype, self.world_size, slots, names, offset
            )
            offset += param.numel
            if original.requires_grad:
                self.trainable.append(param)
            self.params.append(param)
        self._grad_sizes = [p.numel for p in self.trainable]  # the reduce-scatter's flat output, in this order
        self.shard_numel, self.grad_numel = offset, sum(self._grad_sizes)
        self.compute_dtype = compute_dtype or self.params[0].shard.dtype
        self.reduce_dtype = reduce_dtype or self.compute_dtype
        self.device = self.params[0].shard.device
        # NCCL averages in the reduction; gloo has no AVG: it sums, and the mean is taken after.
        self._native_average = "nccl" in str(dist.get_backend(group)).lower() and self.device.type == "cuda"
        self._gathers_cast = any(p.shard.dtype != p.full.dtype for p in self.params)
        # The unit's one master dtype, into which finishing casts all its means at once (None: mixed dtypes).
        masters = {p.shard.dtype for p in self.trainable}
        self._master_dtype = masters.pop() if len(masters) == 1 else None
        # The presence flags every rank sends when it holds every gradient (the common case): read-only, made once.
        self._all_present = torch.ones(
            self.world_size * len(self.trainable), dtype=self.reduce_dtype, device=self.device
        )
        self._gathering: tuple[list[torch.Tensor], dist.Work] | None = None
        self.gathered = False
        self._install(full=False)

    def _install(self, full: bool) -> None:
        for param in self.params:
            for module, name in param.slots:
                set_module_parameter(module, name, param.full if full else param.shard)

    # -- gathering ---------------------------------------------------------------------------

    # Gathering runs twice per unit and step, without torch.no_grad (whose decorator costs as much as the rest):
    # it records nothing for autograd, the shards being read detached and the full parameters written through ``flat``.
    def start_gather(self) -> None:
        """Launch the all-gather of every rank's shards, in the compute dtype (no-op if under way or done)."""
        if self.gathered or self._gathering is not None:
            return
        shards = [p.flat_shard() for p in self.params]
        sent = shards
        if self._gathers_cast:  # one staging buffer, one multi-tensor cast
            staging = torch.empty(self.shard_numel, dtype=self.compute_dtype, device=self.device)
            sent = list(staging.split([p.numel for p in self.params]))
            foreach_copy_(sent, shards)
        targets = [p.allocate() for p in self.params]
        self._gathering = sent, _all_gather_params(targets, sent, self.group)

    def gather(self) -> None:
        """Make the full parameters the module's, gathered (waits for a prefetch started earlier)."""
        if self.gathered:
            return
        self.start_gather()
        _, work = self._gathering
        self._gathering = None
        work.wait()
        self._install(full=True)
        self.gathered = True

    def drop_prefetch(self) -> None:
        """Wait for and discard an all-gather started but not used (its shards may have been stepped since)."""
        if self._gathering is not None:
            self._gathering[1].wait()
            self._gathering = None
            for p in self.params:
                p.release()

    def free(self) -> None:
        """Give the module its shards back and release the gathered copies' memory."""
        if not self.gathered:
            return
        self._install(full=False)
        for p in self.params:
            p.release()
        self.gathered = False

    # -- gradients ---------------------------------------------------------------------------

    @torch.no_grad()
    def start_reduce_scatter(self) -> PendingReduction:
        """Launch the reduce-scatter (the mean over ranks) of the full gradients into every rank's shard; the
        full gradients are handed over to it (``.grad`` set to None) and released when it completes."""
        flags = len(self.trainable)
        output = torch.empty(self.grad_numel + flags, dtype=self.reduce_dtype, device=self.device)
        outputs = list(output.split([*self._grad_sizes, flags]))
        sent, local = [], []
        for p in self.trainable:
            sent.append(self._reduce_input(p))
            local.append(p.full.grad is not None)
            p.full.grad = None
        if all(local):  # no host-device copy on the common path
            sent.append(self._all_present)
        else:
            sent.append(torch.tensor(local, dtype=self.reduce_dtype).repeat(self.world_size).to(self.device))
        op = dist.ReduceOp.AVG if self._native_average else dist.ReduceOp.SUM
        work = _reduce_scatter_grads(outputs, sent, self.group, op)
        return PendingReduction(self, sent, output, work, local)

    def _reduce_input(self, p: ShardedParam) -> torch.Tensor:
        """``p``'s full gradient, flat, in the reduce dtype, with every rank's rows (zeros past the last real
        one; all zeros without a gradient): autograd's tensor itself where it is all that already."""
        grad, size = p.full.grad, p.numel * self.world_size
        if grad is not None and grad.dtype == self.reduce_dtype and grad.numel() == size and grad.is_contiguous():
            return grad.view(-1)
        flat = torch.zeros(size, dtype=self.reduce_dtype, device=self.device)
        if grad is not None:
            flat[: grad.numel()].copy_(grad.reshape(-1))
        return flat

    @torch.no_grad()
    def finish_reduce_scatter(self, pending: PendingReduction) -> None:
        """Wait, then make the mean over ranks each shard's ``.grad`` (master dtype; added if it has one). A
        parameter no rank produced a gradient for keeps ``grad = None``, as one process would leave it."""
        pending.work.wait()
        output = pending.output
        means = output[: self.grad_numel]
        if not self._native_average:
            means.div_(self.world_size)
        if self._master_dtype is not None:
            means = means.to(self._master_dtype)  # one cast for the unit (none if it is the reduce dtype)
        # All present here means present everywhere: no read of the flags (no host-device sync).
        anywhere = pending.local_present if all(pending.local_present) else (output[self.grad_numel :] > 0).tolist()
        for p, grad, present in zip(self.trainable, means.split(self._grad_sizes), anywhere, strict=True):
            if not present:
                continue
            grad = grad.view(p.shard.shape)
            if self._master_dtype is None:
                grad = grad.to(p.shard.dtype)
            if p.shard.grad is None:
                p.shard.grad = grad
            else:
                p.shard.grad.add_(grad)

    # -- full values (checkpoints, teardown) -------------------------------------------------

    @torch.no_grad()
    def gather_like(self, param: ShardedParam, tensor: torch.Tensor) -> torch.Tensor:
        """The full (unsharded) tensor of which ``tensor`` (shaped like ``param``'s shard) is this rank's rows,
        e.g. an optimizer state (a collective)."""
        received = tensor.new_empty(self.world_size * tensor.numel())
        _all_gather_flat(received, tensor.contiguous().view(-1), group=self.group)
        full = tensor.new_empty(param.shape)
        gather_rows(received.view(self.world_size, *tensor.shape), full)
        return full

    @torch.no_grad()
    def gather_masters(self) -> list[torch.Tensor]:
        """Every parameter's full value in the master dtype (a collective; new tensors)."""
        sent = torch.cat([p.shard.detach().reshape(-1) for p in self.params])
        received = sent.new_empty(self.world_size * self.shard_numel)
        _all_gather_flat(received, sent, group=self.group)
        grid = received.view(self.world_size, self.shard_numel)
        fulls = []
        for p in self.params:
            full = sent.new_empty(p.shape)
            gather_rows(grid[:, p.offset : p.offset + p.numel].view(self.world_size, *p.shard.shape), full)
            fulls.append(full)
        return fulls
