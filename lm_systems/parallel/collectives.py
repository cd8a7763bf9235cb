"""The collectives the data-parallel containers share: averaging all-reduce, state broadcast, gradient presence."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from lm_systems.compat.torch import foreach_copy_, foreach_div_, launched_as_one


def require_process_group(who: str) -> None:
    """Raise a clear error when torch.distributed has not been initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{who} needs an initialised process group: call torch.distributed.init_process_group(...) first "
            "(or launch through a Lightning strategy, torchrun or mp.spawn)"
        )


class PendingAverage:
    """In-flight all-reduces; once ``wait()`` returns, the mean over ranks is in the averaged tensors."""

    __slots__ = ("_sent", "_work", "_divisor", "_targets")

    def __init__(
        self, sent: list[torch.Tensor], work: dist.Work | _AllOf, divisor: int | None, targets: list[torch.Tensor]
    ) -> None:
        self._sent, self._work, self._divisor, self._targets = sent, work, divisor, targets

    def wait(self) -> list[torch.Tensor]:
        """Wait, then return the averaged tensors (the ones given to ``GradientAverager.start``)."""
        self._work.wait()
        if self._divisor is not None:
            foreach_div_(self._sent, self._divisor)
        if self._sent is not self._targets:
            foreach_copy_(self._targets, self._sent)
        return self._targets


class GradientAverager:
    """Starts averaging all-reduces on one process group, with the per-call work done once, up front.

    Launches go straight to the group's ``allreduce`` (one tensor) or ``allreduce_coalesced`` (several: on
    NCCL one grouped launch, no flattening copy) with prepared options: a data-parallel container issues
    hundreds per step from autograd's thread, and ``dist.all_reduce``'s argument checks cost as much as
    the launch itself. NCCL averages in the reduction (``ReduceOp.AVG``); gloo has no AVG, so it sums and
    divides after the wait. With ``comm_dtype`` (e.g. bf16 for fp32 gradients) the tensors are cast for
    the wire and the mean cast back into them: half the bytes, at bf16's precision for the sum.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, comm_dtype: torch.dtype | None = None) -> None:
        self.group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.group)
        self.comm_dtype = comm_dtype
        self._nccl = "nccl" in str(dist.get_backend(self.group)).lower()
        self._avg = _allreduce_options(dist.AllreduceOptions, dist.ReduceOp.AVG)
        self._sum = _allreduce_options(dist.AllreduceOptions, dist.ReduceOp.SUM)
        self._avg_many = _allreduce_options(dist.AllreduceCoalescedOptions, dist.ReduceOp.AVG)
        self._sum_many = _allreduce_options(dist.AllreduceCoalescedOptions, dist.ReduceOp.SUM)
        self._reduce: dict[tuple[int, dist.ReduceOp], dist.ReduceOptions] = {}

    def _for_the_wire(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], bool]:
        """What is sent for ``tensors`` (cast to ``comm_dtype`` if it differs), and whether the backend averages."""
        sent = tensors
        if self.comm_dtype is not None and self.comm_dtype != tensors[0].dtype:
            sent = [t.to(self.comm_dtype) for t in tensors]
        return sent, self._nccl and tensors[0].is_cuda

    def start(self, tensors: list[torch.Tensor]) -> PendingAverage:
        """Start averaging ``tensors`` (one device and dtype) in place over the group's ranks."""
        sent, native_avg = self._for_the_wire(tensors)
        if len(sent) == 1:
            work = self.group.allreduce(sent, self._avg if native_avg else self._sum)
        else:
            work = self.group.allreduce_coalesced(sent, self._avg_many if native_avg else self._sum_many)
        return PendingAverage(sent, work, None if native_avg else self.world_size, tensors)

    def start_to_owners(self, tensors: list[torch.Tensor], owners: list[int]) -> PendingAverage:
        """Start reducing each of ``tensors`` to its mean over ranks on the rank ``owners`` names for it (ranks
        of the group), in place there; elsewhere a tensor only sends, and its value afterwards is undefined. On
        NCCL the reduces go out as one grouped launch, as ``allreduce_coalesced`` does for all-reduces."""
        sent, native_avg = self._for_the_wire(tensors)
        op = dist.ReduceOp.AVG if native_avg else dist.ReduceOp.SUM
        works = launched_as_one(
            self.group,
            sent[0].device,
            lambda: [
                self.group.reduce([t], self._reduce_options(owner, op)) for t, owner in zip(sent, owners, strict=True)
            ],
        )
        return PendingAverage(sent, _AllOf(works), None if native_avg else self.world_size, tensors)

    def _reduce_options(self, root: int, op: dist.ReduceOp) -> dist.ReduceOptions:
        key = (root, op)
        if key not in self._reduce:
            options = dist.ReduceOptions()
            options.rootRank, options.reduceOp = root, op
            self._reduce[key] = options
        return self._reduce[key]

    def average(self, tensor: torch.Tensor) -> torch.Tensor:
        """Average ``tensor`` in place and wait for it."""
        return self.start([tensor]).wait()[0]


class _AllOf:
    """Several in-flight collectives, waited for as one."""

    __slots__ = ("_works",)

    def __init__(self, works: list[dist.Work]) -> None:
        self._works = works

    def wait(self) -> None:
        for work in self._works:
            work.wait()


def _allreduce_options(kind: type, op: dist.ReduceOp):
    options = kind()
    options.reduceOp = op
    return options


def gradient_process_group(high_priority: bool = True, max_ctas: int | None = None) -> dist.ProcessGroup | None:
    """A group of all ranks for gradient all-reduces overlapped with backward; ``None`` (the default group)
    unless the default backend is NCCL. A collective: every rank calls it, and destroys the group when done.

    ``high_priority`` puts its NCCL stream at high priority, so an all-reduce's blocks are scheduled as
    soon as backward's kernels free SMs rather than after the kernels queued before them; ``max_ctas``
    caps the thread blocks (SMs) one all-reduce occupies, leaving more to the backward it overlaps.
    """
    if "nccl" not in str(dist.get_backend()).lower():
        return None
    options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=high_priority)
    if max_ctas is not None:
        options.config.max_ctas = max_ctas
    return dist.new_group(backend="nccl", pg_options=options)


@torch.no_grad()
def broadcast_module_state(module: nn.Module, src: int = 0) -> None:
    """Overwrite every parameter and buffer with rank ``src``'s values, so all replicas start identical."""
    tensors = [p.detach() for p in module.parameters()] + list(module.buffers())
    works = [dist.broadcast(t, src=src, async_op=True) for t in tensors]
    for work in works:
        work.wait()


class GradPresence:
    """Agrees across ranks which parameters hold a gradient: a parameter unused everywhere keeps ``grad = None``.

    One small SUM all-reduce of 0/1 flags per synchronisation. A rank whose parameters all have gradients
    need not read the result back (no host-device sync): every count is then at least one.
    """

    def __init__(self, params: Sequence[nn.Parameter], process_group: dist.ProcessGroup | None = None) -> None:
        device = params[0].device if params else torch.device("cpu")
        self._group = process_group
        self._flags = torch.zeros(len(params), dtype=torch.float32, device=device)
        self._local: list[bool] = []
        self._work = None

    def launch(self, local_present: list[bool]) -> None:
        self._local = local_present
        if all(local_present):
            self._flags.fill_(1.0)  # a device-side fill: no host sync on the common path
        else:
            self._flags.copy_(torch.tensor(local_present, dtype=torch.float32))
        self._work = dist.all_reduce(self._flags, op=dist.ReduceOp.SUM, group=self._group, async_op=True)

    def wait(self) -> list[bool]:
        """Per parameter: does any rank hold a gradient for it?"""
        self._work.wait()
        self._work = None
        if all(self._local):
            return self._local
        return [count > 0 for count in self._flags.tolist()]
