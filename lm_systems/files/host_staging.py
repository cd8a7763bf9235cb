"""The copy of a checkpoint's tensors to host memory that an asynchronous save waits for, into buffers kept from one
save to the next.

The project's own rather than torch's ``DefaultStager``, which in torch 2.11 (the floor) drops its buffers, and the
tables its copy needs, after every copy: its second copy fails (2.13's keeps them).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


class HostStager(AsyncStager):
    """Stages a flat ``{key: tensor}`` dict (plain tensors and one-dimensional-mesh DTensors) into host buffers, one
    per key, reused while the key's shape and dtype stay; ``pinned`` (on a CUDA machine): page-locked buffers,
    copied into without blocking, then waited for once. A DTensor comes back as a DTensor of the same layout over a
    host mesh of ``group`` (a gloo group of every rank), so the checkpoint records where each shard belongs.

    The buffers of one save are overwritten by the next: the caller lets a save's write finish first.
    """

    def __init__(self, group: dist.ProcessGroup, pinned: bool) -> None:
        self.group = group
        self.pinned = pinned
        self._ranks = dist.get_process_group_ranks(group)
        self._buffers: dict[str, torch.Tensor] = {}
        self._host_mesh: DeviceMesh | None = None

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False  # stage() returns with the copies done

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        staged = {key: self._stage(key, value) for key, value in state_dict.items()}
        if self.pinned:
            torch.cuda.synchronize()
        return staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` waits for its copies."""

    def close(self) -> None:
        self._buffers.clear()

    def _stage(self, key: str, value: torch.Tensor) -> torch.Tensor:
        if not isinstance(value, DTensor):
            return self._copy(key, value)
        return DTensor.from_local(
            self._copy(key, value.to_local()),
            self._mesh_like(value.device_mesh),
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )

    def _copy(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self.pinned)
            self._buffers[key] = buffer
        buffer.copy_(tensor.detach(), non_blocking=self.pinned)
        return buffer

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
