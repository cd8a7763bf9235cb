"""One unit of fully sharded data parallelism: its parameters split by rows over the ranks, gathered whole
for compute and freed after, its gradients reduce-scattered back into the shards."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from lm_systems.compat.torch import set_module_parameter

# torch 2.13 renamed the flat collectives (the old names warn as deprecated); older releases have only those.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def rows_per_rank(rows: int, world_size: int) -> int:
    """Rows of dim 0 each rank holds: the last rank's share is padded with zero rows up to this."""
    return -(-rows // world_size)


def scatter_rows(full: torch.Tensor, grid: torch.Tensor) -> None:
    """Copy ``full`` (rows, *rest) into ``grid`` (N, rows_per_rank, *rest), rank r's rows into grid[r];
    the padding past the last row is zeroed."""
    per_rank = grid.shape[1]
    whole, rest = divmod(full.shape[0], per_rank)
    grid[:whole].copy_(full[: whole * per_rank].view(whole, per_rank, *full.shape[1:]))
    if whole < grid.shape[0]:
        grid[whole, :rest].copy_(full[whole * per_rank :])
        grid[whole, rest:].zero_()
        grid[whole + 1 :].zero_()


def gather_rows(grid: torch.Tensor, full: torch.Tensor) -> None:
    """The inverse of ``scatter_rows``: ``full`` (rows, *rest) from ``grid`` (N, rows_per_rank, *rest)."""
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
    while the unit is sharded). ``slots`` are the (module, attribute) places that hold it, ``names`` its
    qualified names below the wrapped module."""

    shard: nn.Parameter
    full: nn.Parameter
    shape: torch.Size
    slots: list[tuple[nn.Module, str]]
    names: list[str]
    offset: int = 0  # in the unit's flat shard (all-gather layout)
    grad_offset: int = -1  # in the unit's flat gradient shard (reduce-scatter layout); -1: frozen

    @property
    def numel(self) -> int:
        return self.shard.numel()

    def valid_rows(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """The rows of a shard-shaped ``tensor`` that hold real rows of the parameter (padding excluded)."""
        per_rank = self.shard.shape[0]
        return tensor[: max(0, min(per_rank, self.shape[0] - rank * per_rank))]


@dataclass
class PendingReduction:
    """An in-flight reduce-scatter of one unit's gradients: the summed shard lands in ``output``."""

    unit: "ShardedUnit"
    sent: torch.Tensor
    output: torch.Tensor
    work: dist.Work
    local_present: list[bool] = field(default_factory=list)


class ShardedUnit:
    """The parameters of one submodule (a Transformer block, a layer), sharded by rows over the ranks.

    All-gather layout: each rank contributes its shards of every parameter, concatenated (S elements), so
    the gathered buffer is (N, S) and parameter j's rows sit in columns [offset_j, offset_j + n_j) of
    every rank's row. The reduce-scatter sends the same layout over the trainable parameters, with one
    presence flag per parameter appended to every rank's part, so each rank learns, with its summed
    shard, which parameters got a gradient on any rank.
    """

    def __init__(self, module: nn.Module, prefix: str, params: list[tuple[nn.Parameter, list[tuple[nn.Module, str]],
                 list[str]]], group: dist.ProcessGroup | None, compute_dtype: torch.dtype | None,
                 reduce_dtype: torch.dtype | None) -> None:
        self.module = module
        self.prefix = prefix
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.params: list[ShardedParam] = []
        self.trainable: list[ShardedParam] = []
        offset = grad_offset = 0
        for original, slots, names in params:
            dtype = compute_dtype or original.dtype
            shard = nn.Parameter(shard_rows(original.detach(), self.rank, self.world_size),
                                 requires_grad=original.requires_grad)
            full = nn.Parameter(torch.empty(original.shape, dtype=dtype, device=original.device),
                                requires_grad=original.requires_grad)
            full.untyped_storage().resize_(0)
            param = ShardedParam(shard, full, original.shape, slots, names, offset)
            offset += param.numel
            if original.requires_grad:
                param.grad_offset = grad_offset
                grad_offset += param.numel
                self.trainable.append(param)
            self.params.append(param)
        self.shard_numel, self.grad_numel = offset, grad_offset
        self.compute_dtype = compute_dtype or self.params[0].shard.dtype
        self.reduce_dtype = reduce_dtype or self.compute_dtype
        self.device = self.params[0].shard.device
        self._gathering: tuple[torch.Tensor, dist.Work] | None = None
        self.gathered = False
        self._install(full=False)

    def _install(self, full: bool) -> None:
        for param in self.params:
            for module, name in param.slots:
                set_module_parameter(module, name, param.full if full else param.shard)

    # -- gathering ---------------------------------------------------------------------------

    @torch.no_grad()
    def start_gather(self) -> None:
        """Launch the all-gather of every rank's shards, in the compute dtype (no-op if under way or done)."""
        if self.gathered or self._gathering is not None:
            return
        sent = torch.cat([p.shard.reshape(-1) for p in self.params]).to(self.compute_dtype)  # (S,)
        received = torch.empty(self.world_size * self.shard_numel, dtype=self.compute_dtype, device=self.device)
        self._gathering = received, _all_gather_flat(received, sent, group=self.group, async_op=True)

    @torch.no_grad()
    def gather(self) -> None:
        """Make the full parameters the module's, gathered (waits for a prefetch started earlier)."""
        if self.gathered:
            return
        self.start_gather()
        received, work = self._gathering
        self._gathering = None
        work.wait()
        grid = received.view(self.world_size, self.shard_numel)
        for p in self.params:
            full = p.full.data  # .data: refilling a leaf saved for backward must not bump its version
            full.untyped_storage().resize_(full.numel() * full.element_size())
            gather_rows(grid[:, p.offset : p.offset + p.numel].view(self.world_size, *p.shard.shape), full)
        self._install(full=True)
        self.gathered = True

    def drop_prefetch(self) -> None:
        """Wait for and discard an all-gather started but not used (its shards may have been stepped since)."""
        if self._gathering is not None:
            self._gathering[1].wait()
            self._gathering = None

    def free(self) -> None:
        """Give the module its shards back and release the gathered copies' memory."""
        if not self.gathered:
            return
        self._install(full=False)
        for p in self.params:
            p.full.untyped_storage().resize_(0)
        self.gathered = False

    # -- gradients ---------------------------------------------------------------------------

    def has_local_grads(self) -> bool:
        return any(p.full.grad is not None for p in self.trainable)

    @torch.no_grad()
    def start_reduce_scatter(self) -> PendingReduction:
        """Launch the reduce-scatter (a sum) of the full gradients into every rank's shard; the full
        gradients are released as soon as they are copied into the send buffer."""
        flags = len(self.trainable)
        part = self.grad_numel + flags
        sent = torch.empty(self.world_size, part, dtype=self.reduce_dtype, device=self.device)
        local = []
        for j, p in enumerate(self.trainable):
            grid = sent[:, p.grad_offset : p.grad_offset + p.numel].view(self.world_size, *p.shard.shape)
            present = p.full.grad is not None
            if present:
                scatter_rows(p.full.grad, grid)
                p.full.grad = None
            else:
                grid.zero_()
            local.append(present)
        if all(local):
            sent[:, self.grad_numel :].fill_(1.0)  # a device-side fill: no host-device copy on the common path
        else:
            sent[:, self.grad_numel :] = torch.tensor(local, dtype=self.reduce_dtype)  # (flags,), on every row
        output = torch.empty(part, dtype=self.reduce_dtype, device=self.device)
        work = _reduce_scatter_flat(output, sent.view(-1), op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return PendingReduction(self, sent, output, work, local)

    @torch.no_grad()
    def finish_reduce_scatter(self, pending: PendingReduction) -> None:
        """Wait, then add the mean over ranks into each shard's ``.grad`` (master dtype). A parameter no rank
        produced a gradient for keeps ``grad = None``, as one process would leave it."""
        pending.work.wait()
        output = pending.output
        # All present here means present everywhere: no read of the flags (no host-device sync).
        anywhere = pending.local_present if all(pending.local_present) else \
            (output[self.grad_numel :] > 0).tolist()
        for p, present in zip(self.trainable, anywhere):
            if not present:
                continue
            grad = output[p.grad_offset : p.grad_offset + p.numel].view(p.shard.shape)
            grad = grad.to(p.shard.dtype, copy=True).div_(self.world_size)
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
