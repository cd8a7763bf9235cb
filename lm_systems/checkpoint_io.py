"""SafeCheckpointIO: checkpoint files that are never torn."""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

from lm_systems.atomic_files import atomic_write_path


class SafeCheckpointIO(TorchCheckpointIO):
    """TorchCheckpointIO that writes to a temporary name, then renames.

    A kill at any moment leaves either the previous file or the new one, whole. Lightning's own writer
    serialises the whole checkpoint into memory first and moves it out of the system temp folder (a copy
    when that is another filesystem); this one streams ``torch.save`` into the target folder.
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None or not _is_local_file_protocol(path):
            super().save_checkpoint(checkpoint, path, storage_options)  # remote stores: Lightning's transaction
            return
        with atomic_write_path(path) as tmp, open(tmp, "wb") as file:
            torch.save(checkpoint, file)
            file.flush()
            os.fsync(file.fileno())
