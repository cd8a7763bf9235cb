"""ParameterExchange: after a ZeRO-1 step, every rank's updated parameters reach every other rank, in batches.

The batches are launched together and can be waited on one at a time, so a caller may let the
exchange run while the next forward pass uses the parameters that have already arrived.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist

Exchange = Literal["p2p", "broadcast"]

# Parameters per batch: bounds the size of one NCCL group call of batched sends and receives.
MAX_PARAMS_PER_BATCH = 128


class ParameterExchange:
    """Moves each parameter from its owner to every other rank, ``params`` in order, in batches.

    ``mode="p2p"``: per batch, one batched group of sends from each owner to each peer and receives
    from the owners (all links busy at once, no copies); ``mode="broadcast"``: one broadcast per
    parameter from its owner. A batch closes at ``MAX_PARAMS_PER_BATCH`` parameters or, given
    ``batch_bytes``, once it holds that many bytes.
    """

    def __init__(self, params: list[torch.Tensor], owner: Callable[[torch.Tensor], int], mode: Exchange,
                 batch_bytes: int | None = None) -> None:
        if mode not in ("p2p", "broadcast"):
            raise ValueError(f"exchange must be 'p2p' or 'broadcast', got {mode!r}")
        self._owner = owner
        self._mode = mode
        self._rank, self._world_size = dist.get_rank(), dist.get_world_size()
        self._batches = _batches(params, batch_bytes)
        self._batch_of = {id(p): i for i, batch in enumerate(self._batches) for p in batch}
        self._pending: dict[int, list[dist.Work]] = {}

    @property
    def in_flight(self) -> bool:
        """Whether some launched batch has not been waited for."""
        return bool(self._pending)

    def start(self) -> None:
        """Launch every batch (asynchronously); wait with ``wait_for`` or ``wait_all``."""
        if self._world_size == 1:
            return
        self.wait_all()
        for i, batch in enumerate(self._batches):
            self._pending[i] = self._launch(batch)

    def wait_for(self, params: list[torch.Tensor]) -> None:
        """Until the batches holding ``params`` have arrived (on NCCL: the current stream waits for them)."""
        if not self._pending:
            return
        for i in sorted({self._batch_of[id(p)] for p in params if id(p) in self._batch_of}):
            for work in self._pending.pop(i, ()):
                work.wait()

    def wait_all(self) -> None:
        for i in sorted(self._pending):
            for work in self._pending.pop(i):
                work.wait()

    def _launch(self, batch: list[torch.Tensor]) -> list[dist.Work]:
        if self._mode == "broadcast":
            return [dist.broadcast(p.detach(), src=self._owner(p), async_op=True) for p in batch]
        ops = []
        for p in batch:
            owner = self._owner(p)
            if owner == self._rank:
                ops += [dist.P2POp(dist.isend, p.detach(), peer) for peer in range(self._world_size) if peer != owner]
            else:
                ops.append(dist.P2POp(dist.irecv, p.detach(), owner))
        return dist.batch_isend_irecv(ops)


def _batches(params: list[torch.Tensor], batch_bytes: int | None) -> list[list[torch.Tensor]]:
    batches: list[list[torch.Tensor]] = [[]]
    size = 0
    for p in params:
        if len(batches[-1]) == MAX_PARAMS_PER_BATCH or (batch_bytes is not None and size >= batch_bytes):
            batches.append([])
            size = 0
        batches[-1].append(p)
        size += p.numel() * p.element_size()
    return [batch for batch in batches if batch]
