"""DDPBucketed: gradients live in flat bucket buffers; each bucket's all-reduce starts as soon as it is full."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from lm_systems.parallel.collectives import PendingAverage
from lm_systems.parallel.overlap import OverlappedDDP

MiB = 1024 * 1024


def assign_buckets(params: list[nn.Parameter], bucket_size_mb: float) -> list[list[nn.Parameter]]:
    """Group ``params`` (in the given order) into buckets of at most ``bucket_size_mb`` of one device and dtype.

    A parameter larger than the cap gets a bucket of its own.
    """
    if bucket_size_mb <= 0:
        raise ValueError(f"bucket_size_mb must be positive, got {bucket_size_mb}")
    cap = bucket_size_mb * MiB
    buckets: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        same_kind = bool(buckets) and (buckets[-1][0].device, buckets[-1][0].dtype) == (p.device, p.dtype)
        if same_kind and size + nbytes <= cap:
            buckets[-1].append(p)
            size += nbytes
        else:
            buckets.append([p])
            size = nbytes
    return buckets


class DDPBucketed(OverlappedDDP):
    """Buckets of gradients, in reverse parameter order, each at most ``bucket_size_mb``, averaged asynchronously.

    After the first backward every ``param.grad`` is a view into its bucket's flat buffer (as torch DDP's
    ``gradient_as_bucket_view``): later accumulations land in the bucket directly, and the averaged
    result is already in ``.grad`` with no copy back. A gradient that autograd freshly allocated (after
    ``zero_grad(set_to_none=True)``) is copied into the bucket once, when it is accumulated.
    """

    def __init__(self, module: nn.Module, bucket_size_mb: float = 25.0, process_group: dist.ProcessGroup | None = None,
                 grad_comm_dtype: torch.dtype | None = None) -> None:
        params = [p for p in module.parameters() if p.requires_grad]
        super().__init__(module, assign_buckets(list(reversed(params)), bucket_size_mb), process_group, grad_comm_dtype)
        self.bucket_size_mb = bucket_size_mb
        self._flat_buffers: list[torch.Tensor] = []
        self._grad_views: list[list[torch.Tensor]] = []
        for bucket in self._units:
            buffer = torch.zeros(sum(p.numel() for p in bucket), dtype=bucket[0].dtype, device=bucket[0].device)
            chunks = buffer.split([p.numel() for p in bucket])
            self._flat_buffers.append(buffer)
            self._grad_views.append([chunk.view_as(p) for chunk, p in zip(chunks, bucket)])

    @property
    def buckets(self) -> list[list[nn.Parameter]]:
        """The parameters of each bucket, in launch order."""
        return self._units

    def _place_gradient(self, unit: int, index: int, param: nn.Parameter) -> None:
        view = self._grad_views[unit][index]
        if param.grad.data_ptr() != view.data_ptr():
            view.copy_(param.grad)
            param.grad = view

    def _launch(self, unit: int) -> PendingAverage:
        return self._averager.start(self._flat_buffers[unit])

    def _prepare_late(self, unit: int) -> None:
        for index, param in enumerate(self._units[unit]):
            if param.grad is None:
                self._grad_views[unit][index].zero_()
            else:
                self._place_gradient(unit, index, param)

    def _averaged(self, unit: int, index: int) -> torch.Tensor:
        return self._grad_views[unit][index]
