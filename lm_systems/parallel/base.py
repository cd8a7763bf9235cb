"""What every data-parallel container shares: the start-up broadcast, forward, ``no_sync``, hook bookkeeping and
the container's lifetime (``close()``, ``with``)."""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from lm_systems.parallel.collectives import GradientAverager, broadcast_module_state, require_process_group


class DataParallelModule(nn.Module, ABC):
    """Base of the containers: replicas start from rank 0's weights; subclasses average the gradients.

    Usage, on every rank::

        with BucketedDDP(model, bucket_size_mb=25) as ddp:
            loss_fn(ddp(x), y).backward()
            ddp.finish_gradient_synchronization()   # .grad now holds the mean over ranks
            optimizer.step()
        # closed: hooks removed, launch thread stopped, process group no longer referenced

    Inside ``with model.no_sync():`` backward passes only accumulate locally; the next backward outside it
    (and its ``finish_gradient_synchronization()``) averages the accumulated sum.

    Only parameters with ``requires_grad`` at construction are synchronised. A parameter that gets no
    gradient on some rank counts as zero there; one that gets none on any rank keeps ``grad = None``,
    exactly as single-process training would leave it.

    ``process_group`` (all ranks; default: the default group) carries the gradient all-reduces, e.g. one
    from ``gradient_process_group()`` with a high-priority stream. ``grad_comm_dtype`` sends gradients in
    another dtype (``torch.bfloat16``: half the bytes of fp32) and casts the mean back.
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | None = None,
        grad_comm_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        require_process_group(type(self).__name__)
        self.module = module
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        if process_group is not None and dist.get_world_size(process_group) != self.world_size:
            raise ValueError("process_group must hold every rank: data parallelism averages over all of them")
        self.process_group = process_group
        self._averager = GradientAverager(process_group, grad_comm_dtype)
        self.require_backward_grad_sync = True
        self._hook_handles: list[RemovableHandle] = []
        broadcast_module_state(module, src=0)

    def __enter__(self) -> DataParallelModule:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """End the container's life: remove its hooks (``remove_hooks``) and drop its process group, so that once
        the caller destroys the group nothing of it (gloo's and the TCPStore's threads) outlives the container's
        use. The wrapped ``module`` stays usable on its own; the container is not. Calling it again does nothing."""
        self.remove_hooks()
        self.process_group = None
        self._averager = None

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Parameters to synchronise, in registration order (tied weights appear once)."""
        return [p for p in self.module.parameters() if p.requires_grad]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._require_open()
        return self.module(*args, **kwargs)

    def _require_open(self) -> None:
        if self._averager is None:
            raise RuntimeError(
                f"this {type(self).__name__} was closed (hooks removed, process group dropped): train its module "
                "through a new container, or call it directly"
            )

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally and communicate nothing."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    @abstractmethod
    def finish_gradient_synchronization(self) -> None:
        """Wait for (or run) the gradient all-reduces; afterwards ``.grad`` holds the mean over ranks."""

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """The global 2-norm of the synchronised gradients: every rank holds them all, so it is this rank's norm (a
        container whose ranks hold different gradients combines theirs)."""
        grads = [p.grad for p in self.trainable_parameters() if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the synchronised gradients to a global 2-norm of at most ``max_norm``; the norm before clipping."""
        return torch.nn.utils.clip_grad_norm_(self.trainable_parameters(), max_norm)

    def _add_hook(self, handle: RemovableHandle) -> None:
        self._hook_handles.append(handle)

    def _weak_hook(self, method: Callable[..., None], *bound: Any) -> Callable[..., None]:
        """A hook calling ``method`` (one of this container's) with ``bound`` before the hook's own arguments, holding
        the container weakly: a hook left on a parameter does not keep the container, and the process group it
        holds, alive after its last use."""
        container, function = weakref.ref(self), method.__func__  # a WeakMethod call costs twice as much

        def hook(*args: Any) -> None:
            live = container()
            if live is not None:
                function(live, *bound, *args)

        return hook

    def remove_hooks(self) -> None:
        """Detach the container from its parameters' autograd hooks (gradients stay as they are)."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()
