"""zero3: FullyShardedDataParallel (ZeRO-3: parameters, gradients and optimizer state sharded) as a Lightning
strategy."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, Optional

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lm_systems.compat.lightning import optimizer_to_device
from lm_systems.parallel import DataParallelModule, FullyShardedDataParallel
from lm_systems.training.strategy_offers import COMM_DTYPES, ShardingUnits
from strategies.checkpoint_dirs import CheckpointDirStrategy
from strategies.data_parallel import ContainerDDPStrategy
from strategies.sharded_grad_scaler import agree_on_overflow

COMPUTE_DTYPES = ("auto", "bf16", "fp16", "fp32")


def resolve_compute_dtype(choice: str, precision: str) -> Optional[torch.dtype]:
    """The dtype zero3 gathers weights in for ``choice`` under Lightning's ``precision``; None: the masters'."""
    if choice == "auto":
        return torch.bfloat16 if precision.startswith("bf16") else None
    return COMM_DTYPES.get(choice)


class Zero3Strategy(CheckpointDirStrategy, ContainerDDPStrategy):
    """Trains through a FullyShardedDataParallel: each rank holds 1/N of every unit's parameters, gradients and
    optimizer state. The units are those the LightningModule names in ``sharding_units()``
    (:class:`lm_systems.training.strategy_offers.ShardingUnits`; LitLM's: each Transformer block) and every linear or
    embedding layer outside them.

    ``configure_optimizers`` sees the shards (same names, modules and dims), so the user's optimizer and
    schedulers drive them unchanged. Accumulation (``accumulate_grad_batches``) keeps unsharded gradients
    between boundaries (the container's ``no_sync``). Clipping by norm (``gradient_clip_val``, or the
    strategy's ``clip_grad_norm_``) takes the global norm over all ranks' shards; with ``16-mixed``
    the GradScaler is torch's ShardedGradScaler, which agrees on skipped steps across ranks.

    ``compute_dtype`` is the dtype weights are gathered and computed in (masters and optimizer state stay
    float32). ``auto`` (the default): bf16 under a bf16 precision, as torch FSDP2's mixed-precision policy
    does, else the masters' dtype. bf16 halves the all-gather and reduce-scatter bytes and keeps no autocast
    copy of every weight from its forward to its backward; embeddings and the residual stream are computed
    in bf16 too. ``fp32`` gathers float32 weights that autocast casts per operation: the numerics of the
    other strategies, at twice the traffic. ``fp16`` (under ``16-mixed``) gathers fp16.

    ``prefetch``: how many units ahead each unit's all-gather starts (1, the default: the next one; 0: none,
    each unit gathers as it starts). Each unit more holds one more gathered unit in memory and gives a rank's
    all-gathers that much longer to wait for a slower rank before its compute needs them.

    Checkpoints are directories every rank writes its shards into, in the background
    (:class:`strategies.checkpoint_dirs.CheckpointDirStrategy`); with ``checkpoint_format="file"``, one file of the
    LightningModule's full state dict and each optimizer's full state in the plain optimizer's format, gathered by
    every rank and saved by rank 0. Either resumes under zero3 on any number of devices, or under any other strategy;
    zero3 loads those of other strategies.
    """

    strategy_name = "zero3"
    strategy_description = "ZeRO-3: FullyShardedDataParallel, parameters, gradients and optimizer state sharded"

    def __init__(
        self, compute_dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto", prefetch: int = 1, **kwargs: Any
    ) -> None:
        if compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(
                f"compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {compute_dtype!r} "
                "(--strategy zero3: --trainer.strategy.compute_dtype)"
            )
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(
                f"prefetch must be a whole number of units, 0 or more, got {prefetch!r} "
                "(--strategy zero3: --trainer.strategy.prefetch)"
            )
        super().__init__(**kwargs)
        self._compute_dtype = compute_dtype
        self._prefetch = prefetch

    @override
    def wrap(self, module: Module, **comm: Any) -> DataParallelModule:
        dtype = resolve_compute_dtype(self._compute_dtype, str(self.precision_plugin.precision))
        _, units = module.sharding_units() if isinstance(module, ShardingUnits) else (module, ())
        return FullyShardedDataParallel(module, compute_dtype=dtype, units=units, prefetch=self._prefetch, **comm)

    @property
    def _sharded(self) -> Optional[FullyShardedDataParallel]:
        return self.model if isinstance(self.model, FullyShardedDataParallel) else None

    @override
    def setup(self, trainer: Trainer) -> None:
        super().setup(trainer)
        if self._sharded is None:  # not fitting: the module stays whole on every rank
            return
        agree_on_overflow(self.precision_plugin, self.root_device, self._grad_group)  # each rank unscales its shards

    # -- checkpoints: a directory of every rank's shards (CheckpointDirStrategy), or one file of the full state ----

    @override
    def global_view(self, param: Tensor, tensor: Tensor) -> Tensor:
        return tensor if self._sharded is None else self._sharded.global_view(param, tensor)

    @override
    def full_shape(self, param: Tensor) -> torch.Size:
        return param.shape if self._sharded is None else self._sharded.full_shape(param)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._sharded is None or self.writes_directories:
            return super().lightning_module_state_dict()
        return self._sharded.full_state_dict()  # a collective: Lightning asks every rank

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self._sharded is None or self.restored_from_directory:
            super().load_model_state_dict(checkpoint, strict=strict)
        else:
            self._sharded.load_full_state_dict(checkpoint["state_dict"], strict=strict)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        if self._sharded is None or self.writes_directories:
            return super().optimizer_state(optimizer)
        state = self._sharded.full_optimizer_state_dict(optimizer)  # a collective: Lightning asks every rank
        return state if self.is_global_zero else {}

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self._sharded is None or self.restored_from_directory:
            super().load_optimizer_state_dict(checkpoint)
            return
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
            self._sharded.load_full_optimizer_state_dict(optimizer, state)
            optimizer_to_device(optimizer, self.root_device)
