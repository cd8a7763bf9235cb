"""Lightning strategies over lm_systems.parallel's containers: naive_ddp, overlap_ddp and bucketed_ddp.

They subclass Lightning's DDPStrategy, so process-group setup, the launchers (popen re-running the script,
spawn), cluster environments (torchrun, SLURM), ``num_nodes``, distributed samplers and ``sync_dist``
logging are Lightning's own. What changes is the model wrapper and where gradients get averaged:

- ``wrap_model`` wraps the LightningModule in the container (which broadcasts rank 0's weights), and torch
  DDP's hooks are left out (:class:`lm_systems.compat.lightning.ModelWrappingDDPStrategy`);
- ``block_backward_sync`` enters the container's ``no_sync()``, so non-boundary micro-batches of gradient
  accumulation communicate nothing;
- ``post_backward`` calls ``finish_gradient_synchronization()`` after a syncing backward, before the
  precision plugin's unscaling, clipping and ``on_before_optimizer_step``, which thus see averaged gradients;
- ``grad_norm`` and ``clip_grad_norm_`` (:class:`lm_systems.training.strategy_offers.GlobalGradNorm`) are the
  container's: the norm over every rank's gradients, for containers that shard them; ``setup`` routes Lightning's
  own clipping there too (LitLM clips through the same two methods); the ranks agree to stop for SIGTERM over a gloo
  group of CPU tensors instead of Lightning's per-batch device broadcast, which waits for the GPU
  (:class:`strategies.sigterm.HostSigtermStrategy`);
- ``teardown`` closes the container (hooks off, launch thread stopped, process group dropped) and unwraps the
  module.

Every strategy takes communication options (NCCL only):
``comm_high_priority`` and ``comm_max_ctas`` average gradients on a process group of their own whose
stream is high priority (its all-reduces get SMs as soon as backward's kernels free them) and whose
all-reduces use at most that many thread blocks (leaving the other SMs to backward); and
``grad_comm_dtype`` ("bf16"/"fp16") sends gradients in that dtype (half the bytes of fp32) and casts
the mean back. The strategies that communicate during backward (overlap_ddp, bucketed_ddp, zero1) also
take ``launch_thread`` (default on): the all-reduces are launched from a thread of their own instead of
from the gradient hooks on autograd's thread, which keeps them from delaying backward's own launches on
launch-bound hosts.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Generator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, ClassVar, Literal, Optional

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn import Module
from typing_extensions import override

from lm_systems.compat.lightning import ModelWrappingDDPStrategy
from lm_systems.parallel import (
    BucketedDDP,
    DataParallelModule,
    NaiveDDP,
    PerParameterDDP,
    default_bucket_size_mb,
    gradient_buckets,
    gradient_process_group,
    runs_within_buckets,
)
from lm_systems.training.strategy_offers import COMM_DTYPES, GlobalGradNorm, LocalGradNorm
from strategies.sigterm import HostSigtermStrategy

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]


class ContainerDDPStrategy(HostSigtermStrategy, ModelWrappingDDPStrategy):
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
        comm_high_priority: bool = False,
        comm_max_ctas: Optional[int] = None,
        grad_comm_dtype: Optional[Literal["bf16", "fp16"]] = None,
    ) -> None:
        if comm_max_ctas is not None and comm_max_ctas < 1:
            raise ValueError(
                f"comm_max_ctas must be a positive number of thread blocks or None, got {comm_max_ctas} "
                "(strategy init_args.comm_max_ctas)"
            )
        if grad_comm_dtype is not None and grad_comm_dtype not in COMM_DTYPES:
            raise ValueError(
                f"grad_comm_dtype must be one of {sorted(COMM_DTYPES)} or None, got {grad_comm_dtype!r} "
                "(strategy init_args.grad_comm_dtype)"
            )
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
        self._comm_high_priority = comm_high_priority
        self._comm_max_ctas = comm_max_ctas
        self._grad_comm_dtype = COMM_DTYPES.get(grad_comm_dtype) if grad_comm_dtype else None
        self._grad_group: Optional[dist.ProcessGroup] = None

    @abstractmethod
    def wrap(self, module: Module, **comm: Any) -> DataParallelModule:
        """The container this strategy trains through; ``comm`` goes to its constructor."""

    @override
    def wrap_model(self, model: Module) -> DataParallelModule:
        own_group = self._comm_high_priority or self._comm_max_ctas is not None
        if own_group and self._grad_group is None:  # None unless the backend is NCCL
            self._grad_group = gradient_process_group(self._comm_high_priority, self._comm_max_ctas)
        return self.wrap(model, process_group=self._grad_group, grad_comm_dtype=self._grad_comm_dtype)

    @override
    def setup(self, trainer: Trainer) -> None:
        super().setup(trainer)
        # A LightningModule that leaves clipping to Lightning reaches the precision plugin, which would clip the
        # gradients this rank holds by their own norm: it takes this strategy's global one, as LitLM does.
        self.precision_plugin.clip_grad_by_norm = lambda optimizer, clip_val: self.clip_grad_norm_(clip_val)

    def grad_norm(self) -> torch.Tensor:
        """The global 2-norm of the synchronised gradients over every rank's (:class:`GlobalGradNorm`)."""
        return self._gradients().grad_norm()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the global 2-norm over every rank's gradients; the norm before clipping (:class:`GlobalGradNorm`)."""
        return self._gradients().clip_grad_norm_(max_norm)

    def _gradients(self) -> GlobalGradNorm:
        """The container, which knows the norm over every rank; outside fit (no container), torch's over the module."""
        if isinstance(self.model, DataParallelModule):
            return self.model
        return LocalGradNorm(self.lightning_module.parameters())

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
            self.model.close()
            self.model = self.lightning_module
        if self._grad_group is not None:
            dist.destroy_process_group(self._grad_group)
            self._grad_group = None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for suffix, start_method in (("", "popen"), ("_spawn", "spawn")):
            name = cls.strategy_name + suffix
            if name not in strategy_registry:
                strategy_registry.register(
                    name,
                    cls,
                    description=f"{cls.strategy_description} (start_method={start_method!r})",
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
    def wrap(self, module: Module, **comm: Any) -> DataParallelModule:
        return NaiveDDP(module, flat=self._flat, **comm)


class LaunchThreadDDPStrategy(ContainerDDPStrategy):
    """Base of the strategies whose containers launch all-reduces during backward; ``launch_thread`` as above."""

    def __init__(self, launch_thread: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._launch_thread = launch_thread


class OverlapDDPStrategy(LaunchThreadDDPStrategy):
    """Launches each parameter's gradient all-reduce during backward, as soon as the gradient is ready."""

    strategy_name = "overlap_ddp"
    strategy_description = "PerParameterDDP: per-parameter all-reduce overlapped with backward"

    @override
    def wrap(self, module: Module, **comm: Any) -> DataParallelModule:
        return PerParameterDDP(module, launch_thread=self._launch_thread, **comm)


class BucketedDDPStrategy(LaunchThreadDDPStrategy):
    """Bucketed gradient all-reduce overlapped with backward; ``bucket_size_mb`` caps each bucket.

    ``bucket_size_mb`` None (the default) picks by the hosts: 1000 MB on one host, 25 MB across hosts (see
    ``lm_systems.parallel.default_bucket_size_mb``). ``.inf`` (YAML's infinity, on the command line too) asks
    for one bucket, averaged once backward has ended.
    """

    strategy_name = "bucketed_ddp"
    strategy_description = "BucketedDDP: bucketed all-reduce overlapped with backward"

    def __init__(self, bucket_size_mb: Optional[float] = None, **kwargs: Any) -> None:
        if bucket_size_mb is not None and not bucket_size_mb > 0:
            raise ValueError(
                f"bucket_size_mb must be positive (or None to pick by the hosts), got {bucket_size_mb} "
                "(strategy init_args.bucket_size_mb)"
            )
        super().__init__(**kwargs)
        self._bucket_size_mb = bucket_size_mb

    @property
    def bucket_size_mb(self) -> float:
        """The cap the gradients are bucketed by: the one given, else the default for the number of hosts."""
        return self._bucket_size_mb or default_bucket_size_mb(self.num_nodes)

    def block_runs(self, module: Module, blocks: Sequence[Module]) -> list[int]:
        """The runs of consecutive ``blocks`` whose gradients all land in one of the buckets ``wrap(module)`` will
        make, as sizes: what ``--model.compile buckets`` compiles as one graph each
        (:class:`lm_systems.training.strategy_offers.BlockRuns`)."""
        return runs_within_buckets(blocks, gradient_buckets(module, self.bucket_size_mb))

    @override
    def wrap(self, module: Module, **comm: Any) -> DataParallelModule:
        cap = self.bucket_size_mb
        wrapped = BucketedDDP(module, bucket_size_mb=cap, launch_thread=self._launch_thread, **comm)
        plan = (
            "in one bucket, once backward has ended"
            if math.isinf(cap)
            else f"in {len(wrapped.buckets)} bucket(s) of at most {cap:g} MB, each launched once filled"
        )
        chosen = " (the default; set bucket_size_mb to change)" if self._bucket_size_mb is None else ""
        rank_zero_info(f"{self.strategy_name}: gradients averaged {plan}{chosen}")
        return wrapped
