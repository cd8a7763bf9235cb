"""The collectives the data-parallel containers share: averaging all-reduce, state broadcast, gradient presence."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn


def require_process_group(who: str) -> None:
    """Raise a clear error when torch.distributed has not been initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{who} needs an initialised process group: call torch.distributed.init_process_group(...) first "
            "(or launch through a Lightning strategy, torchrun or mp.spawn)"
        )


def _supports_avg(tensor: torch.Tensor) -> bool:
    """NCCL averages in the reduction itself; gloo has no ReduceOp.AVG, so it sums and divides afterwards."""
    return tensor.is_cuda and "nccl" in str(dist.get_backend()).lower()


class PendingAverage:
    """An in-flight all-reduce that leaves the mean over ranks in its tensor once ``wait()`` returns."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self._world_size = dist.get_world_size()
        self._divide_after = not _supports_avg(tensor)
        op = dist.ReduceOp.SUM if self._divide_after else dist.ReduceOp.AVG
        self._work = dist.all_reduce(tensor, op=op, async_op=True)

    def wait(self) -> torch.Tensor:
        self._work.wait()
        if self._divide_after:
            self.tensor.div_(self._world_size)
        return self.tensor


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

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        device = params[0].device if params else torch.device("cpu")
        self._flags = torch.zeros(len(params), dtype=torch.float32, device=device)
        self._local: list[bool] = []
        self._work = None

    def launch(self, local_present: list[bool]) -> None:
        self._local = local_present
        if all(local_present):
            self._flags.fill_(1.0)  # a device-side fill: no host sync on the common path
        else:
            self._flags.copy_(torch.tensor(local_present, dtype=torch.float32))
        self._work = dist.all_reduce(self._flags, op=dist.ReduceOp.SUM, async_op=True)

    def wait(self) -> list[bool]:
        """Per parameter: does any rank hold a gradient for it?"""
        self._work.wait()
        self._work = None
        if all(self._local):
            return self._local
        return [count > 0 for count in self._flags.tolist()]
