"""zero1: bucketed gradient averaging plus ZeRO-1 (optimizer state sharded over ranks) as a Lightning strategy."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, Literal, Optional

from lightning.pytorch import Trainer
from torch import Tensor
from torch.nn import Parameter
from torch.optim import Optimizer
from typing_extensions import override

from lm_systems.parallel import DataParallelModule, OwnedGradients, ShardedOptimizer, optimizer_init_kwargs
from lm_systems.parallel.sharded_optimizer import Exchange
from strategies.checkpoint_dirs import CheckpointDirStrategy
from strategies.data_parallel import BucketedDDPStrategy
from strategies.sharded_grad_scaler import agree_on_overflow

GradReduce = Literal["all_reduce", "owner"]


class Zero1Strategy(CheckpointDirStrategy, BucketedDDPStrategy):
    """BucketedDDP gradients and every optimizer from ``configure_optimizers`` wrapped in a ShardedOptimizer.

    The wrapper takes over the user's param-group dicts themselves, so learning-rate schedulers built on
    the user's optimizer keep driving the groups that are stepped. Checkpoints are directories each rank writes
    the optimizer state of the parameters it steps into (:class:`strategies.checkpoint_dirs.CheckpointDirStrategy`);
    with ``checkpoint_format="file"``, one file of one consolidated optimizer state (Lightning calls
    ``consolidate_state_dict`` on every rank, then saves rank 0's) in the plain optimizer's format. Either resumes
    under zero1 on any number of devices, or under any other strategy. ``exchange`` and ``exchange_stages`` are the
    ShardedOptimizer's: how updated parameters reach the other ranks, and in how many stages that exchange is
    pipelined with the update; with ``comm_high_priority`` (NCCL) gradients and exchange run on a high-priority
    group of their own.

    The defaults differ from ShardedOptimizer's (one stage, default group): the update pipelined with the
    exchange in 4 stages on a high-priority stream, which is where the pipeline pays (docs/data_parallel.md).
    Clipping (``gradient_clip_val``) is sharded too: each rank takes the norm of and scales only the gradients of
    the parameters it steps, and the ranks sum their squared norms; the others' gradients stay unscaled.

    ``grad_reduce="owner"`` (the default) reduces each gradient only to the rank that steps its parameter instead
    of all-reducing it (the bytes of a reduce-scatter, not an all-reduce; ZeRO-2's gradient path), and drops it on
    the other ranks. Hooks after synchronisation (``on_before_optimizer_step``) then see this rank's gradients only;
    a 16-mixed GradScaler sums its overflow flags over the ranks, so that they agree on skipping a step.
    ``"all_reduce"`` leaves every rank all the averaged gradients, as bucketed_ddp does.
    """

    strategy_name = "zero1"
    strategy_description = "ZeRO-1: BucketedDDP gradients, ShardedOptimizer state"

    def __init__(
        self,
        bucket_size_mb: Optional[float] = None,
        exchange: Exchange = "p2p",
        exchange_stages: int = 4,
        comm_high_priority: bool = True,
        grad_reduce: GradReduce = "owner",
        **kwargs: Any,
    ) -> None:
        if grad_reduce not in ("all_reduce", "owner"):
            raise ValueError(
                f"grad_reduce must be 'all_reduce' or 'owner', got {grad_reduce!r} (strategy init_args.grad_reduce)"
            )
        if exchange not in ("p2p", "broadcast"):
            raise ValueError(f"exchange must be 'p2p' or 'broadcast', got {exchange!r} (strategy init_args.exchange)")
        if exchange_stages < 1:
            raise ValueError(
                f"exchange_stages must be at least 1, got {exchange_stages} (strategy init_args.exchange_stages)"
            )
        super().__init__(bucket_size_mb=bucket_size_mb, comm_high_priority=comm_high_priority, **kwargs)
        self._exchange = exchange
        self._exchange_stages = exchange_stages
        self._grad_reduce = grad_reduce

    @override
    def setup(self, trainer: Trainer) -> None:
        super().setup(trainer)
        if self._grad_reduce == "owner":  # each rank unscales only the gradients it owns
            agree_on_overflow(self.precision_plugin, self.root_device, self._grad_group)

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        super().setup_optimizers(trainer)
        sharded = [self._shard(optimizer) for optimizer in self.optimizers]
        for original, wrapped in zip(self.optimizers, sharded, strict=True):
            for config in self.lr_scheduler_configs:
                if config.scheduler.optimizer is original:
                    config.scheduler.optimizer = wrapped
        self.optimizers = sharded
        if isinstance(self.model, DataParallelModule):
            if self._grad_reduce == "owner":
                self.model.assign_owners(OwnedGradients(_owner_lookup(sharded), reduce_to_owner=True))
            else:  # a parameter no optimizer holds still counts in the norm, once: rank 0 takes it
                self.model.assign_owners(OwnedGradients(_owner_lookup(sharded, default=0), reduce_to_owner=False))

    @override
    def teardown(self) -> None:
        for optimizer in self.optimizers:
            if isinstance(optimizer, ShardedOptimizer):
                optimizer.close()  # before the strategy destroys the group it holds
        super().teardown()

    @override
    def holds_state(self, optimizer: Optimizer, param: Tensor) -> bool:
        return not isinstance(optimizer, ShardedOptimizer) or optimizer.owner(param) == optimizer.rank

    @override
    def local_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return optimizer.local_state_dict() if isinstance(optimizer, ShardedOptimizer) else optimizer.state_dict()

    def _shard(self, optimizer: Optimizer) -> ShardedOptimizer:
        if isinstance(optimizer, ShardedOptimizer):
            return optimizer
        wrapped = ShardedOptimizer(
            optimizer.param_groups,
            type(optimizer),
            exchange=self._exchange,
            exchange_stages=self._exchange_stages,
            process_group=self._grad_group,
            **optimizer_init_kwargs(optimizer),
        )
        if any(a is not b for a, b in zip(wrapped.param_groups, optimizer.param_groups, strict=True)):
            raise RuntimeError(
                "ShardedOptimizer did not adopt the optimizer's param-group dicts; schedulers would not reach it"
            )
        # The scheduler wrapped the user's optimizer.step to check call order; it now drives the wrapper,
        # whose step runs in the right order but carries no such mark.
        warnings.filterwarnings("ignore", message="Seems like `optimizer.step\\(\\)` has been overridden")
        return wrapped


def _owner_lookup(sharded: list[ShardedOptimizer], default: Optional[int] = None) -> Callable[[Parameter], int]:
    """The rank that steps a parameter, over every sharded optimizer; for one none of them holds, ``default``, or
    without it a clear error."""
    owners = {
        id(p): optimizer.owner(p) for optimizer in sharded for group in optimizer.param_groups for p in group["params"]
    }

    def owner(param: Parameter) -> int:
        if id(param) in owners:
            return owners[id(param)]
        if default is None:
            raise ValueError(
                f"zero1's grad_reduce 'owner' needs every trainable parameter in an optimizer, but one "
                f"of shape {tuple(param.shape)} is in none: no rank would step it; put it in one, or "
                "set --trainer.strategy.grad_reduce all_reduce"
            )
        return default

    return owner
