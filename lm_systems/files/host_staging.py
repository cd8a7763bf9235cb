"""The copy of a checkpoint's tensors to host memory that an asynchronous save waits for, into one buffer kept from
one save to the next.

The project's own rather than torch's ``DefaultStager``, which in torch 2.11 (the floor) drops its buffers, and the
tables its copy needs, after every copy: its second copy fails (2.13's keeps them). The buffer is an anonymous mapping
page-locked in place (``cudaHostRegister``), not ``pin_memory=True``: torch's pinned allocator rounds each request
up to a power of two (docs/checkpointing.md).
"""

from __future__ import annotations

import ctypes
import math
import mmap
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

ALIGNMENT = 64  # bytes: every key's place in the buffer starts at a multiple, whatever its dtype


class HostStager(AsyncStager):
    """Stages a flat ``{key: tensor}`` dict (plain tensors and one-dimensional-mesh DTensors) into one host mapping,
    a tensor over its own bytes of it per key, reused while the keys, shapes and dtypes stay; ``pinned`` (on a CUDA
    machine): the mapping is page-locked, copied into without blocking, then waited for once. A DTensor comes back
    as a DTensor of the same layout over a host mesh of ``group`` (a gloo group of every rank), so the checkpoint
    records where each shard belongs.

    The host copy of one save is overwritten by the next: the caller lets a save's write finish first.
    """

    def __init__(self, group: dist.ProcessGroup, pinned: bool) -> None:
        self.group = group
        self.pinned = pinned
        self._ranks = dist.get_process_group_ranks(group)
        self._registered: int | None = None  # the address of the page-locked mapping
        self._views: dict[str, torch.Tensor] = {}
        self._host_mesh: DeviceMesh | None = None

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False  # stage() returns with the copies done

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        local = {key: value.to_local() if isinstance(value, DTensor) else value for key, value in state_dict.items()}
        layout = _layout(local)
        if layout != _layout(self._views):
            self._allocate(layout)
        for key, tensor in local.items():
            self._views[key].copy_(tensor.detach(), non_blocking=self.pinned)
        if self.pinned:
            torch.cuda.synchronize()
        return {key: self._as_staged(value, self._views[key]) for key, value in state_dict.items()}

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` waits for its copies."""

    def close(self) -> None:
        self._release()

    def _allocate(self, layout: list[tuple[str, torch.Size, torch.dtype]]) -> None:
        """One mapping of the bytes ``layout`` needs (each key's place rounded up to ``ALIGNMENT``), and a tensor per
        key whose storage is exactly its own bytes of it: DCP's writer copies a tensor whose storage is larger."""
        self._release()
        sizes = [math.prod(shape) * dtype.itemsize for _, shape, dtype in layout]
        places = [-(-size // ALIGNMENT) * ALIGNMENT for size in sizes]
        memory = mmap.mmap(-1, max(sum(places), 1))  # anonymous, page-aligned: what cudaHostRegister locks in place
        if self.pinned:
            address = ctypes.addressof(ctypes.c_char.from_buffer(memory))
            _check_cuda(torch.cuda.cudart().cudaHostRegister(address, len(memory), 0), "cudaHostRegister")
            self._registered = address
        offset = 0
        for (key, shape, dtype), size, place in zip(layout, sizes, places, strict=True):
            if size:
                view = torch.frombuffer(memory, dtype=dtype, count=size // dtype.itemsize, offset=offset)
                self._views[key] = view.view(shape)
            else:
                self._views[key] = torch.empty(shape, dtype=dtype)
            offset += place

    def _release(self) -> None:
        """Unlock the mapping; it is unmapped once the last tensor over it (a save being written) is gone."""
        address, self._registered = self._registered, None
        self._views = {}
        if address is not None:
            _check_cuda(torch.cuda.cudart().cudaHostUnregister(address), "cudaHostUnregister")

    def _as_staged(self, value: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
        if not isinstance(value, DTensor):
            return host
        return DTensor.from_local(
            host,
            self._mesh_like(value.device_mesh),
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )

    def _mesh_like(self, mesh: DeviceMesh) -> DeviceMesh:
        """The host mesh standing in for ``mesh``: the same ranks in the same order, over ``group``."""
        if mesh.ndim != 1 or mesh.mesh.tolist() != self._ranks:
            raise ValueError(
                f"a checkpoint directory holds DTensors over one mesh dimension of all ranks in order ({self._ranks}); "
                f"got a mesh of shape {tuple(mesh.mesh.shape)} over {mesh.mesh.flatten().tolist()}"
            )
        if self._host_mesh is None:
            self._host_mesh = DeviceMesh.from_group(self.group, "cpu")
        return self._host_mesh


def _layout(tensors: dict[str, torch.Tensor]) -> list[tuple[str, torch.Size, torch.dtype]]:
    return [(key, tensor.shape, tensor.dtype) for key, tensor in tensors.items()]


def _check_cuda(code: Any, call: str) -> None:
    if int(code) != 0:
        raise RuntimeError(f"{call} of the checkpoint's host buffer failed with CUDA error {int(code)}")
