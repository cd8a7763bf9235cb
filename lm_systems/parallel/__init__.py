"""Data parallelism in plain torch.distributed (no Lightning): gradient-averaging containers, ZeRO-1 and ZeRO-3.

- ``NaiveDDP(module, flat=False)``: all-reduce after backward, per parameter or flattened.
- ``PerParameterDDP(module)``: per-parameter async all-reduce launched during backward.
- ``BucketedDDP(module, bucket_size_mb)``: bucketed async all-reduce, in place in autograd's own gradients;
  ``default_bucket_size_mb(hosts)`` the cap the strategies pick when none is given, ``gradient_buckets`` its plan,
  ``runs_within_buckets`` the runs of blocks that can compile as one graph each without delaying a bucket.
- ``ShardedOptimizer(params, optimizer_cls, **kwargs)``: optimizer state sharded over ranks (ZeRO stage 1);
  ``OwnedGradients(owner)`` handed to an overlapping container (``assign_owners``) reduces each gradient to the rank
  that steps it and clips there.
- ``FullyShardedDataParallel(module, compute_dtype=None, units=())``: parameters, gradients and optimizer state
  sharded over ranks (ZeRO stage 3), each unit (those named, and every linear or embedding layer outside them)
  gathered just before its forward and its backward.
- ``gradient_process_group()``: an NCCL group with a high-priority stream for the containers' all-reduces.

Each container and the ShardedOptimizer owns its lifetime: ``close()`` (or leaving a ``with`` block) removes its
hooks, stops its launch thread and drops its process group.
"""

from lm_systems.parallel.base import DataParallelModule
from lm_systems.parallel.bucketed import (
    BucketedDDP,
    assign_buckets,
    default_bucket_size_mb,
    gradient_buckets,
    runs_within_buckets,
)
from lm_systems.parallel.collectives import gradient_process_group
from lm_systems.parallel.fully_sharded import FullyShardedDataParallel
from lm_systems.parallel.naive import NaiveDDP
from lm_systems.parallel.overlap import OverlappedDDP, PerParameterDDP
from lm_systems.parallel.owned_gradients import OwnedGradients
from lm_systems.parallel.sharded_optimizer import ShardedOptimizer, optimizer_init_kwargs

__all__ = [
    "BucketedDDP",
    "DataParallelModule",
    "FullyShardedDataParallel",
    "NaiveDDP",
    "OverlappedDDP",
    "OwnedGradients",
    "PerParameterDDP",
    "ShardedOptimizer",
    "assign_buckets",
    "default_bucket_size_mb",
    "gradient_buckets",
    "gradient_process_group",
    "optimizer_init_kwargs",
    "runs_within_buckets",
]
