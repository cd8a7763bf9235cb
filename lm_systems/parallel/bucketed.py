"""BucketedDDP: gradients averaged in buckets, each bucket's all-reduce started as soon as its gradients are in."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from lm_systems.parallel.overlap import OverlappedDDP

MiB = 1024 * 1024
ONE_HOST_BUCKET_MB = 1000.0
ACROSS_HOSTS_BUCKET_MB = 25.0


def default_bucket_size_mb(hosts: int) -> float:
    """The bucket cap when none is given, chosen from measurements on one host of NVLinked GPUs
    (docs/data_parallel.md): ONE_HOST_BUCKET_MB, a few large buckets, few launches on a host-bound eager step and,
    compiled, only the last of them left to average after backward. Across hosts (a slower link, not measured
    here), torch DDP's 25 MB."""
    return ACROSS_HOSTS_BUCKET_MB if hosts > 1 else ONE_HOST_BUCKET_MB


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


def gradient_buckets(module: nn.Module, bucket_size_mb: float) -> list[list[nn.Parameter]]:
    """The buckets ``BucketedDDP(module, bucket_size_mb)`` averages: ``module``'s trainable parameters in reverse
    registration order (about the order backward produces their gradients), in launch order."""
    params = [p for p in module.parameters() if p.requires_grad]
    return assign_buckets(list(reversed(params)), bucket_size_mb)


def runs_within_buckets(blocks: Sequence[nn.Module], buckets: list[list[nn.Parameter]]) -> list[int]:
    """The sizes, in order, of runs of consecutive ``blocks`` whose parameters all lie in one of ``buckets``; a
    block whose parameters span buckets (or that has none) is a run of its own.

    Compiled as one graph, a run hands every gradient over as its backward ends, that is as its first block's
    ends. A bucket holding the run cannot launch before then anyway (it waits for that block's gradients), and no
    other bucket holds any of them: a graph per run delays no bucket's all-reduce.
    """
    bucket_of = {id(p): index for index, bucket in enumerate(buckets) for p in bucket}
    runs: list[int] = []
    previous: set[int | None] = set()
    for block in blocks:
        home = {bucket_of.get(id(p)) for p in block.parameters() if p.requires_grad}
        if runs and len(home) == 1 and home == previous:
            runs[-1] += 1
        else:
            runs.append(1)
        previous = home
    return runs


class BucketedDDP(OverlappedDDP):
    """Buckets of gradients, in reverse parameter order, each at most ``bucket_size_mb``, averaged asynchronously.

    A bucket's all-reduce starts once autograd has accumulated every gradient in it, and averages
    autograd's own gradient tensors in place: one coalesced collective per bucket (NCCL groups its
    tensors into one launch), with no flat buffer to copy into and out of. Gradients thus live where
    single-process training keeps them: created by backward, freed by ``zero_grad(set_to_none=True)``.
    A flat buffer that gradients are views of (torch DDP's ``gradient_as_bucket_view``) would instead be
    zeroed every step and make autograd add each gradient into it, reading and writing the gradients'
    bytes several times over on a GPU that backward already keeps busy, and would hold their memory
    through the forward pass.
    """

    def __init__(
        self,
        module: nn.Module,
        bucket_size_mb: float = 25.0,
        process_group: dist.ProcessGroup | None = None,
        grad_comm_dtype: torch.dtype | None = None,
        launch_thread: bool = False,
    ) -> None:
        super().__init__(
            module, gradient_buckets(module, bucket_size_mb), process_group, grad_comm_dtype, launch_thread
        )
        self.bucket_size_mb = bucket_size_mb

    @property
    def buckets(self) -> list[list[nn.Parameter]]:
        """The parameters of each bucket, in launch order (its ``units``)."""
        return self.units
