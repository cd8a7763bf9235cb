"""fsdp2: torch's own FSDP2 (``fully_shard``) over the LightningModule's sharding units (a TransformerLM's blocks), the
reference zero3 is measured against."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any, Optional

import lightning.pytorch as L
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from typing_extensions import override

from lm_systems.compat.lightning import DataParallelMeshStrategy
from lm_systems.training.strategy_offers import ShardingUnits
from strategies.checkpoint_dirs import CheckpointDirStrategy
from strategies.sigterm import HostSigtermStrategy

BF16_PRECISIONS = ("bf16-mixed", "bf16-true")


class FSDP2Strategy(CheckpointDirStrategy, HostSigtermStrategy, DataParallelMeshStrategy):
    """Lightning's ModelParallelStrategy (data parallel only) with FSDP2 applied by the strategy itself:
    ``fully_shard`` on each unit the LightningModule's ``sharding_units()`` names (LitLM: each Transformer block),
    then on the module its forward runs (the whole model), so a LitLM trains under it unchanged.

    Under a bf16 precision, parameters are gathered in bf16 and gradients reduce-scattered in float32
    (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32)``); the float32 masters and the
    optimizer state stay sharded. The model is built on the device, as under ``ddp``, so both start from the
    same weights. Checkpoints are directories of every rank's DTensor shards
    (:class:`strategies.checkpoint_dirs.CheckpointDirStrategy`), or with ``checkpoint_format="file"`` one file of
    the full state dict, gathered to rank 0, as the unsharded strategies write.
    ``reshard_after_forward`` frees each block's gathered weights after its forward (and
    gathers them again for backward), as zero3 does. The ranks agree on SIGTERM over the host, as under the other
    strategies here (``strategies.sigterm``), so the comparison with zero3 leaves Lightning's per-batch sync out
    of both.
    """

    strategy_name = "fsdp2"

    def __init__(self, reshard_after_forward: bool = True, **kwargs: Any) -> None:
        super().__init__(tensor_parallel_size=1, save_distributed_checkpoint=False, **kwargs)
        self._reshard_after_forward = reshard_after_forward

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        # On the device, as DDPStrategy builds the model: the same initial weights as under the other strategies
        # (drawn from the device's generator), and no initialisation of a large model on the host first.
        with torch.device(self.root_device), super().tensor_init_context(empty_init):
            yield

    @override
    def setup(self, trainer: L.Trainer) -> None:
        self._shard(self.lightning_module, str(trainer.precision))
        super().setup(trainer)

    def _shard(self, module: L.LightningModule, precision: str) -> None:
        if not isinstance(module, ShardingUnits):
            raise TypeError(
                f"--strategy fsdp2 shards the units a LightningModule names in sharding_units() "
                f"(lm_systems.training.strategy_offers.ShardingUnits); {type(module).__name__} has no such method"
            )
        root, units = module.sharding_units()
        policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if precision in BF16_PRECISIONS
            else MixedPrecisionPolicy()
        )
        mesh = self.device_mesh["data_parallel"]
        for unit in units:
            fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=self._reshard_after_forward)
        fully_shard(root, mesh=mesh, mp_policy=policy, reshard_after_forward=self._reshard_after_forward)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description="torch FSDP2 (fully_shard) per block")
