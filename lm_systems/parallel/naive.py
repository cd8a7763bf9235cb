"""NaiveDDP: average gradients after backward, with no overlap; the baseline the other containers beat."""

from __future__ import annotations

import torch
import torch.nn as nn

from lm_systems.parallel.base import DataParallelModule
from lm_systems.parallel.collectives import GradPresence, PendingAverage


class NaiveDDP(DataParallelModule):
    """After backward, all-reduce each gradient in turn (``flat=False``) or all of them as one flat tensor."""

    def __init__(self, module: nn.Module, flat: bool = False) -> None:
        super().__init__(module)
        self.flat = flat
        self._params = self.trainable_parameters()
        self._presence = GradPresence(self._params)

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        if not self._params:
            return
        local = [p.grad is not None for p in self._params]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params]
        averaged = self._average_flat(grads) if self.flat else [PendingAverage(g).wait() for g in grads]
        self._presence.launch(local)
        for param, grad, anywhere in zip(self._params, averaged, self._presence.wait()):
            param.grad = grad if anywhere else None

    @staticmethod
    def _average_flat(grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """One all-reduce per (device, dtype): gradients of mixed dtypes cannot share a flat buffer."""
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, g in enumerate(grads):
            groups.setdefault((g.device, g.dtype), []).append(i)
        averaged: list[torch.Tensor] = [torch.empty(0)] * len(grads)
        for indices in groups.values():
            flat = PendingAverage(torch.cat([grads[i].reshape(-1) for i in indices])).wait()  # (Σ numel,)
            chunks = flat.split([grads[i].numel() for i in indices])
            for i, chunk in zip(indices, chunks):
                averaged[i] = chunk.view_as(grads[i])
        return averaged
