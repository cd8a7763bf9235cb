"""DDPBucketed: gradients live in flat bucket buffers; each bucket's all-reduce starts as soon as it is full."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

import torch
import torch.distributed as dist
import torch.nn as nn

from lm_systems.parallel.collectives import PendingAverage
from lm_systems.parallel.overlap import OverlappedDDP
from lm_systems.parallel.peer_copy import CopyEngineAverager, PendingCopyAverage

MiB = 1024 * 1024
AllReduce = Literal["process_group", "copy_engine"]
ALLREDUCE_CHOICES: tuple[str, ...] = get_args(AllReduce)
# (numel, dtype, device, largest slice) -> a zeroed flat buffer
Allocate = Callable[[int, torch.dtype, torch.device, int], torch.Tensor]


def assign_buckets(params: list[nn.Parameter], bucket_size_mb: float) -> list[list[nn.Parameter]]:
    """Group ``params`` (in the order their gradients arrive) into buckets of at most ``bucket_size_mb`` of
    one device and dtype, listed in the order they fill up.

    A parameter larger than the cap gets a bucket of its own, listed where it stands; the bucket being
    filled stays open across it, so the small parameters around large ones (norm weights beside a
    layer's matrices) share buckets instead of each closing one early. For an xl model at 25 MB this
    makes ~220 all-reduces per step instead of 291: each costs the launching thread about 14 CUDA calls.
    """
    if bucket_size_mb <= 0:
        raise ValueError(f"bucket_size_mb must be positive, got {bucket_size_mb}")
    cap = bucket_size_mb * MiB
    full: list[tuple[int, list[nn.Parameter]]] = []  # (position of the bucket's last parameter, bucket)
    filling: list[nn.Parameter] = []
    size, last = 0, 0
    for position, p in enumerate(params):
        nbytes = p.numel() * p.element_size()
        if nbytes > cap:
            full.append((position, [p]))
            continue
        same_kind = bool(filling) and (filling[0].device, filling[0].dtype) == (p.device, p.dtype)
        if filling and not (same_kind and size + nbytes <= cap):
            full.append((last, filling))
            filling, size = [], 0
        filling.append(p)
        size, last = size + nbytes, position
    if filling:
        full.append((last, filling))
    return [bucket for _, bucket in sorted(full, key=lambda entry: entry[0])]


class DDPBucketed(OverlappedDDP):
    """Buckets of gradients, in reverse parameter order, each at most ``bucket_size_mb``, averaged asynchronously.

    Gradients live in the buckets (as torch DDP's ``gradient_as_bucket_view``): the buckets of one device
    and dtype are consecutive slices of one flat buffer, and each ``param.grad`` is a view into its
    bucket. The first gradient to arrive after a synchronisation points every other ``.grad`` at its view
    (zeroed where it was ``None``: one fill of the flat buffer when all were), so autograd accumulates the
    rest straight into the buckets in C++, the per-gradient hooks only count arrivals, and the averaged
    result is already in ``.grad``: no copies in or out, which matters because the hooks run on autograd's
    thread between backward's kernel launches. Attaching at the first arrival, not at the forward, keeps
    this right when gradients are zeroed between forward and backward (as Lightning does). A gradient that
    arrives outside its view anyway is copied into it once.

    ``allreduce`` picks how a bucket is averaged: ``"process_group"``, the group's all-reduce (NCCL, gloo);
    or ``"copy_engine"`` (CUDA, every rank on one node): the flat buffers live in symmetric memory and
    buckets are averaged by peer copies that the GPUs' copy engines carry, leaving the SMs to backward
    (``peer_copy.py``; no ``grad_comm_dtype`` there).
    """

    def __init__(self, module: nn.Module, bucket_size_mb: float = 25.0, process_group: dist.ProcessGroup | None = None,
                 grad_comm_dtype: torch.dtype | None = None, launch_thread: bool = False,
                 allreduce: AllReduce = "process_group") -> None:
        if allreduce not in ALLREDUCE_CHOICES:
            raise ValueError(f"allreduce must be one of {ALLREDUCE_CHOICES}, got {allreduce!r}")
        if allreduce == "copy_engine" and grad_comm_dtype is not None:
            raise ValueError("allreduce='copy_engine' averages gradients in their own dtype: leave grad_comm_dtype None")
        params = [p for p in module.parameters() if p.requires_grad]
        super().__init__(module, assign_buckets(list(reversed(params)), bucket_size_mb), process_group, grad_comm_dtype,
                         launch_thread)
        self.bucket_size_mb = bucket_size_mb
        self.allreduce = allreduce
        allocate: Allocate = _zeros
        if allreduce == "copy_engine":
            self._averager = CopyEngineAverager(process_group)
            allocate = self._averager.allocate
        self._arenas, self._flat_buffers = _carve_buckets(self._units, allocate)
        self._grad_views = [[chunk.view_as(p) for chunk, p in zip(buffer.split([p.numel() for p in bucket]), bucket)]
                            for buffer, bucket in zip(self._flat_buffers, self._units)]
        self._views = [view for views in self._grad_views for view in views]  # aligned with self._params
        self._attached = False
        self._had_grad = [False] * len(self._params)  # at attachment: .grad held a gradient already

    @property
    def buckets(self) -> list[list[nn.Parameter]]:
        """The parameters of each bucket, in launch order (its ``units``)."""
        return self.units

    @torch.no_grad()
    def _attach_gradients(self) -> None:
        """Point every ``.grad`` at its bucket view, keeping whatever gradient it holds."""
        grads = [p.grad for p in self._params]
        self._had_grad = [g is not None for g in grads]
        fill = not any(g is v for g, v in zip(grads, self._views))  # no view holds a gradient to keep
        if fill:
            for arena in self._arenas:
                arena.zero_()
        for param, view, grad in zip(self._params, self._views, grads):
            if grad is view:
                continue
            if grad is None:
                if not fill:
                    view.zero_()
            elif grad.data_ptr() != view.data_ptr():
                view.copy_(grad)
            param.grad = view
        self._attached = True

    def _place_gradient(self, unit: int, index: int, param: nn.Parameter) -> None:
        if not self._attached:
            self._attach_gradients()
            return
        view = self._grad_views[unit][index]
        if param.grad is not view:
            with torch.no_grad():
                if param.grad.data_ptr() != view.data_ptr():
                    view.copy_(param.grad)
                param.grad = view

    def _local_presence(self) -> list[bool]:
        if not self._attached:
            return super()._local_presence()
        # A view attached to a parameter that held no gradient, and got none since, is not a gradient.
        return [p.grad is not None and (p.grad is not view or had or got)
                for p, view, had, got in zip(self._params, self._views, self._had_grad, self._got_grad)]

    def _launch(self, unit: int) -> PendingAverage | PendingCopyAverage:
        return self._averager.start(self._flat_buffers[unit])

    def _prepare_late(self, unit: int) -> None:
        for index, param in enumerate(self._units[unit]):
            if param.grad is None:
                self._grad_views[unit][index].zero_()
            else:
                self._place_gradient(unit, index, param)

    def _averaged(self, unit: int, index: int) -> torch.Tensor:
        return self._grad_views[unit][index]

    def _reset(self) -> None:
        super()._reset()
        self._attached = False
        self._had_grad = [False] * len(self._params)


def _zeros(numel: int, dtype: torch.dtype, device: torch.device, largest_slice: int) -> torch.Tensor:
    return torch.zeros(numel, dtype=dtype, device=device)


def _carve_buckets(buckets: list[list[nn.Parameter]], allocate: Allocate) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One zeroed flat buffer per (device, dtype), from ``allocate``, and each bucket's consecutive slice of it."""
    sizes: dict[tuple[torch.device, torch.dtype], int] = {}
    largest: dict[tuple[torch.device, torch.dtype], int] = {}
    for bucket in buckets:
        kind = (bucket[0].device, bucket[0].dtype)
        n = sum(p.numel() for p in bucket)
        sizes[kind] = sizes.get(kind, 0) + n
        largest[kind] = max(largest.get(kind, 0), n)
    arenas = {kind: allocate(n, kind[1], kind[0], largest[kind]) for kind, n in sizes.items()}
    offsets = dict.fromkeys(sizes, 0)
    slices = []
    for bucket in buckets:
        kind = (bucket[0].device, bucket[0].dtype)
        n = sum(p.numel() for p in bucket)
        slices.append(arenas[kind][offsets[kind]:offsets[kind] + n])
        offsets[kind] += n
    return list(arenas.values()), slices
