"""Checkpoint files that are never torn and never hold non-finite weights: SafeCheckpointIO and its checks."""

from __future__ import annotations

import math
import os
from typing import Any, Iterable, Optional

import torch
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

from lm_systems.atomic_files import atomic_write_path
from lm_systems.errors import RunError
from lm_systems.nonfinite import divergence_advice


class NonFiniteWeightsError(RunError):
    """A checkpoint was not written because the weights hold NaN or inf."""

    def __init__(self, step: Optional[int], path: _PATH) -> None:
        super().__init__(
            f"the weights are not finite (NaN or inf) at step {step}: {str(path)!r} was not written and the "
            f"previous checkpoints (last.ckpt included) are kept. Training diverged: {divergence_advice()}"
        )


def weights_are_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """True when no floating-point tensor holds NaN or inf: one fused max-abs pass per device and dtype, one sync."""
    floating = [t.detach() for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()]
    # The inf-norm is a max |x|: it never overflows, and NaN propagates through it.
    return bool(torch.nn.utils.get_total_norm(floating, norm_type=math.inf, foreach=True).isfinite())


class SafeCheckpointIO(TorchCheckpointIO):
    """TorchCheckpointIO that refuses non-finite weights and writes to a temporary name, then renames.

    A kill at any moment leaves either the previous file or the new one, whole. Lightning's own writer
    serialises the whole checkpoint into memory first and moves it out of the system temp folder (a copy
    when that is another filesystem); this one streams ``torch.save`` into the target folder.
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Optional[Any] = None) -> None:
        if not weights_are_finite(checkpoint.get("state_dict", {}).values()):
            raise NonFiniteWeightsError(checkpoint.get("global_step"), path)
        if storage_options is not None or not _is_local_file_protocol(path):
            super().save_checkpoint(checkpoint, path, storage_options)  # remote stores: Lightning's transaction
            return
        with atomic_write_path(path) as tmp, open(tmp, "wb") as file:
            torch.save(checkpoint, file)
            file.flush()
            os.fsync(file.fileno())
