"""Lightning strategies over lm_systems.parallel's containers: naive_ddp, overlap_ddp and bucketed_ddp.

They subclass Lightning's DDPStrategy, so process-group setup, the launchers (popen re-running the script,
spawn), cluster environments (torchrun, SLURM), ``num_nodes``, distributed samplers and ``sync_dist``
logging are Lightning's own. What changes is the model wrapper and where gradients get averaged:

- ``_setup_model`` wraps the LightningModule in the container (which broadcasts rank 0's weights);
- ``block_backward_sync`` enters the container's ``no_sync()``, so non-boundary micro-batches of gradient
  accumulation communicate nothing;
- ``post_backward`` calls ``finish_gradient_synchronization()`` after a syncing backward, before the
  precision plugin's unscaling, clipping and ``on_before_optimizer_step``, which thus see averaged gradients;
- ``teardown`` removes the container's gradient hooks and unwraps the module.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, ClassVar, Literal, Optional

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from torch.nn import Module
from typing_extensions import override

from lm_systems.parallel import DataParallelModule, DDPBucketed, DDPIndividualParameters, NaiveDDP

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]


class ContainerDDPStrategy(DDPStrategy):
    """Base: a DDPStrategy whose model wrapper is a container from ``lm_systems.parallel``."""

    strategy_name: ClassVar[str]
    strategy_description: ClassVar[str]

    def __init__(
        self,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: StartMethod = "popen",
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )

    @abstractmethod
    def wrap(self, module: Module) -> DataParallelModule:
        """The container this strategy trains through."""

    @override
    def _setup_model(self, model: Module) -> DataParallelModule:
        return self.wrap(model)

    @override
    def _register_ddp_hooks(self) -> None:
        # DDPStrategy's version asserts a torch DistributedDataParallel model on CUDA; the container
        # registered its own gradient hooks when it was built.
        pass

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        if isinstance(self.model, DataParallelModule):
            with self.model.no_sync():
                yield
        else:
            yield

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        if isinstance(self.model, DataParallelModule) and self.model.require_backward_grad_sync:
            self.model.finish_gradient_synchronization()

    @override
    def teardown(self) -> None:
        if isinstance(self.model, DataParallelModule):
            self.model.remove_hooks()
            self.model = self.lightning_module
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for suffix, start_method in (("", "popen"), ("_spawn", "spawn")):
            name = cls.strategy_name + suffix
            if name not in strategy_registry:
                strategy_registry.register(
                    name, cls, description=f"{cls.strategy_description} (start_method={start_method!r})",
                    start_method=start_method,
                )


class NaiveDDPStrategy(ContainerDDPStrategy):
    """Averages gradients after backward: one all-reduce per parameter, or one flat one with ``flat=True``."""

    strategy_name = "naive_ddp"
    strategy_description = "NaiveDDP: all-reduce every gradient after backward"

    def __init__(self, flat: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._flat = flat

    @override
    def wrap(self, module: Module) -> DataParallelModule:
        return NaiveDDP(module, flat=self._flat)


class OverlapDDPStrategy(ContainerDDPStrategy):
    """Launches each parameter's gradient all-reduce during backward, as soon as the gradient is ready."""

    strategy_name = "overlap_ddp"
    strategy_description = "DDPIndividualParameters: per-parameter all-reduce overlapped with backward"

    @override
    def wrap(self, module: Module) -> DataParallelModule:
        return DDPIndividualParameters(module)


class BucketedDDPStrategy(ContainerDDPStrategy):
    """Bucketed gradient all-reduce overlapped with backward; ``bucket_size_mb`` caps each bucket."""

    strategy_name = "bucketed_ddp"
    strategy_description = "DDPBucketed: bucketed all-reduce overlapped with backward"

    def __init__(self, bucket_size_mb: float = 25.0, **kwargs: Any) -> None:
        if bucket_size_mb <= 0:
            raise ValueError(f"bucket_size_mb must be positive, got {bucket_size_mb} (strategy init_args.bucket_size_mb)")
        super().__init__(**kwargs)
        self._bucket_size_mb = bucket_size_mb

    @override
    def wrap(self, module: Module) -> DataParallelModule:
        return DDPBucketed(module, bucket_size_mb=self._bucket_size_mb)
