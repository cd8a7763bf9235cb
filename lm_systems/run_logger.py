"""RunLogger: TensorBoard logging into a version folder that no other run shares."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from typing_extensions import override

_RUN_CHECKPOINT = re.compile(r"^version_(\d+)$")


class RunLogger(TensorBoardLogger):
    """TensorBoardLogger that claims its ``version_N`` folder with an atomic ``mkdir``.

    Lightning picks ``max(existing) + 1`` from a listing, so two runs started together in one folder
    both took ``version_0`` and overwrote each other's checkpoints and ``config.yaml``. Here the global
    rank 0 creates the folder, and the first to create it owns it; the other moves on to the next number.
    """

    @override
    def _get_next_version(self) -> int:
        version = super()._get_next_version()
        if rank_zero_only.rank != 0 or not _is_local_file_protocol(self.root_dir):
            return version  # other ranks read rank 0's folder (Lightning broadcasts it); remote stores list
        os.makedirs(self.root_dir, exist_ok=True)
        while True:
            try:
                os.mkdir(os.path.join(self.root_dir, f"version_{version}"))
                return version
            except FileExistsError:
                version += 1


def run_version_of(ckpt_path: str | Path) -> Optional[tuple[str, str, int]]:
    """``(save_dir, name, N)`` of a checkpoint inside ``<save_dir>/<name>/version_N/checkpoints/``, else None."""
    path = Path(ckpt_path).resolve()
    if len(path.parents) < 4 or path.parent.name != "checkpoints":
        return None
    match = _RUN_CHECKPOINT.match(path.parents[1].name)
    if match is None:
        return None
    return str(path.parents[3]), path.parents[2].name, int(match.group(1))
