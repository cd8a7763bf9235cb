"""NaiveDDP: average gradients after backward, with no overlap; the baseline the other containers beat."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from lm_systems.parallel.base import DataParallelModule
from lm_systems.parallel.collectives import GradPresence


class NaiveDDP(DataParallelModule):
    """After backward, all-reduce each gradient in turn (``flat=False``) or all of them as one flat tensor."""

    def __init__(
        self,
        module: nn.Module,
        flat: bool = False,
        process_group: dist.ProcessGroup | None = None,
        grad_comm_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(module, process_group, grad_comm_dtype)
        self.flat = flat
        self._params = self.trainable_parameters()
        self._presence = GradPresence(self._params, self.process_group)

    def close(self) -> None:
        super().close()
        self._presence = None

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        if not self._params:
            return
        local = [p.grad is not None for p in self._params]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params]
        averaged = self._average_flat(grads) if self.flat else [self._averager.average(g) for g in grads]
        self._presence.launch(local)
        for param, grad, anywhere in zip(self._params, averaged, self._presence.wait(), strict=True):
            param.grad = grad if anywhere else None

    def _average_flat(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """One all-reduce per (device, dtype): gradients of mixed dtypes cannot share a flat buffer."""
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, g in enumerate(grads):
            groups.setdefault((g.device, g.dtype), []).append(i)
        averaged: list[torch.Tensor] = [torch.empty(0)] * len(grads)
        for indices in groups.values():
            flat = self._averager.average(torch.cat([grads[i].reshape(-1) for i in indices]))  # (Σ numel,)
            chunks = flat.split([grads[i].numel() for i in indices])
            for i, chunk in zip(indices, chunks, strict=True):
                averaged[i] = chunk.view_as(grads[i])
        return averaged
