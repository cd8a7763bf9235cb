"""All-reduce by peer copies: averaging gradient buckets over the GPUs of one node with copy engines, not SMs.

An NCCL all-reduce's kernel holds SMs for as long as the collective is in flight, waiting for the other
rank included, and overlapped with backward it competes with backward's kernels for them. Here every
rank's gradient buffer lives in
symmetric memory, which each peer can address, and a bucket is averaged as a reduce-scatter followed by an
all-gather made of device-to-device copies into the peers' memory, which the copy engines carry over
NVLink (the idea of torch's "low-contention" symmetric-memory collectives):

1. push: for every peer p, copy my part p of the bucket into p's inbox, in the slot kept for me;
2. barrier;
3. reduce: add the peers' copies of my part (now in my inbox) to my part, then divide by the world size;
4. gather: copy my averaged part into every peer's bucket, at the same place;
5. barrier: every part of the bucket is averaged on every rank.

Only step 3 (elementwise kernels over 1/N of the bucket) and the barriers (one thread block) use SMs.
The steps of all buckets run in order on one stream, so one inbox sized for the largest bucket serves
them all: a rank pushes bucket b+1 only after the barrier ending bucket b, which each peer reaches after
reducing out of its inbox. Each part is reduced by one rank and copied to the others, so the replicas'
gradients are bitwise equal.

An option, not a default; what it measured is in docs/findings/data_parallel_scaling.md.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

GRADS, INBOX = "grads", "inbox"


class PeerMemory(Protocol):
    """Buffers ``GRADS`` and ``INBOX`` of every rank of a group, addressable from this rank."""

    rank: int
    world_size: int

    def buffer(self, rank: int, name: str, offset: int, numel: int) -> torch.Tensor:
        """Elements ``[offset, offset + numel)`` of ``rank``'s buffer ``name``."""

    def barrier(self) -> None:
        """Return (on CUDA: let the stream go on) once every rank has reached this barrier."""


def part_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each rank's part of a bucket of ``numel`` elements, as equal as integers allow."""
    edges = [numel * k // world_size for k in range(world_size + 1)]
    return [(edges[k], edges[k + 1] - edges[k]) for k in range(world_size)]


def inbox_slot(sender: int, receiver: int, world_size: int) -> int:
    """Which of ``receiver``'s ``world_size - 1`` inbox slots holds the part ``sender`` pushes to it."""
    return (sender - receiver - 1) % world_size


def slot_numel(largest_bucket: int, world_size: int) -> int:
    """Capacity of one inbox slot: the largest part of the largest bucket."""
    return -(-largest_bucket // world_size)


def average_in_place(memory: PeerMemory, offset: int, numel: int, slot: int) -> None:
    """Steps 1-5 above for the bucket at ``[offset, offset + numel)`` of every rank's ``GRADS``; ``slot`` is
    the inbox slots' capacity. On CUDA this only enqueues work on the current stream."""
    rank, world_size = memory.rank, memory.world_size
    parts = part_bounds(numel, world_size)
    peers = [(rank + k) % world_size for k in range(1, world_size)]
    for peer in peers:
        start, length = parts[peer]
        if length:
            inbox = memory.buffer(peer, INBOX, inbox_slot(rank, peer, world_size) * slot, length)
            inbox.copy_(memory.buffer(rank, GRADS, offset + start, length))
    memory.barrier()
    start, length = parts[rank]
    if length:
        own = memory.buffer(rank, GRADS, offset + start, length)
        for peer in peers:
            own.add_(memory.buffer(rank, INBOX, inbox_slot(peer, rank, world_size) * slot, length))
        own.div_(world_size)
        for peer in peers:
            memory.buffer(peer, GRADS, offset + start, length).copy_(own)
    memory.barrier()


class SymmetricPeerMemory:
    """A gradient buffer and an inbox in CUDA symmetric memory (one node): peers' buffers are plain tensors
    on this device, so a ``copy_`` into them is a device-to-device copy the copy engines carry.

    A collective to construct: every rank of ``group`` builds one with the same sizes, in the same order.
    """

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, inbox_numel: int,
                 group: dist.ProcessGroup, barrier_timeout: timedelta) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.grads = symm_mem.empty(numel, dtype=dtype, device=device).zero_()
        inbox = symm_mem.empty(max(inbox_numel, 1), dtype=dtype, device=device)
        self._local = {GRADS: self.grads, INBOX: inbox}
        try:
            self._handles = {name: symm_mem.rendezvous(tensor, group) for name, tensor in self._local.items()}
        except Exception as error:
            raise RuntimeError(
                "allreduce='copy_engine' could not map the peers' gradient buffers (CUDA symmetric memory): it "
                "needs every rank on one node with peer access between the GPUs; use allreduce='process_group'"
            ) from error
        self._timeout_ms = int(barrier_timeout.total_seconds() * 1000)
        self._views: dict[tuple[int, str, int, int], torch.Tensor] = {}

    def buffer(self, rank: int, name: str, offset: int, numel: int) -> torch.Tensor:
        if rank == self.rank:
            return self._local[name].narrow(0, offset, numel)
        key = (rank, name, offset, numel)
        view = self._views.get(key)
        if view is None:  # a bucket's views are the same every step: build them once
            view = self._views[key] = self._handles[name].get_buffer(rank, (numel,), self.grads.dtype, offset)
        return view

    def barrier(self) -> None:
        self._handles[GRADS].barrier(channel=0, timeout_ms=self._timeout_ms)


class PendingCopyAverage:
    """A bucket being averaged on the copy stream; ``wait()`` makes the current stream wait for it."""

    __slots__ = ("_done", "_tensor")

    def __init__(self, done: torch.cuda.Event, tensor: torch.Tensor) -> None:
        self._done, self._tensor = done, tensor

    def wait(self) -> torch.Tensor:
        torch.cuda.current_stream(self._tensor.device).wait_event(self._done)
        return self._tensor


class CopyEngineAverager:
    """``GradientAverager``'s ``start``/``average`` for slices of gradient buffers that it allocated itself
    (``allocate``) in symmetric memory, averaged by ``average_in_place`` on a high-priority stream of its own.

    Every rank of ``process_group`` must be on one node. Each allocation is a collective, as is each
    ``start`` (same slices, same order on every rank, like any all-reduce). A barrier that waits longer than
    ``barrier_timeout`` for a peer traps on the device instead of hanging.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None,
                 barrier_timeout: timedelta = timedelta(minutes=10)) -> None:
        self.group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.group)
        self._barrier_timeout = barrier_timeout
        self._memories: list[tuple[SymmetricPeerMemory, int]] = []  # (memory, inbox slot capacity)
        self._stream: torch.cuda.Stream | None = None

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device, largest_slice: int) -> torch.Tensor:
        """A zeroed gradient buffer of ``numel`` elements whose slices, none over ``largest_slice``, ``start`` averages."""
        if device.type != "cuda":
            raise ValueError(f"allreduce='copy_engine' averages gradients on CUDA GPUs of one node, not on {device.type}: "
                             "use allreduce='process_group'")
        slot = slot_numel(largest_slice, self.world_size)
        memory = SymmetricPeerMemory(numel, dtype, device, slot * (self.world_size - 1), self.group,
                                     self._barrier_timeout)
        self._memories.append((memory, slot))
        if self._stream is None:
            self._stream = torch.cuda.Stream(device, priority=-1)
        return memory.grads

    def start(self, tensor: torch.Tensor) -> PendingCopyAverage:
        """Start averaging ``tensor`` (a slice of an allocated buffer) in place over the group's ranks."""
        memory, slot = self._owner(tensor)
        offset = (tensor.data_ptr() - memory.grads.data_ptr()) // tensor.element_size()
        self._stream.wait_stream(torch.cuda.current_stream(tensor.device))  # its gradients are in place
        with torch.cuda.stream(self._stream):
            average_in_place(memory, offset, tensor.numel(), slot)
        return PendingCopyAverage(self._stream.record_event(), tensor)

    def average(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.start(tensor).wait()

    def _owner(self, tensor: torch.Tensor) -> tuple[SymmetricPeerMemory, int]:
        for memory, slot in self._memories:
            begin = memory.grads.data_ptr()
            end = begin + memory.grads.numel() * memory.grads.element_size()
            if memory.grads.dtype == tensor.dtype and begin <= tensor.data_ptr() < end:
                return memory, slot
        raise ValueError("CopyEngineAverager averages slices of the buffers it allocated, and this tensor is not one")
