"""RunConfigFile: where LightningCLI writes the run's ``config.yaml``."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.cli import SaveConfigCallback


class RunConfigFile(SaveConfigCallback):
    """LightningCLI's ``config.yaml`` in the run's log folder; none without a logger (``--trainer.logger false``),
    where Lightning wrote it into the working directory (each checkpoint keeps the run's settings anyway)."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if trainer.logger is not None:
            super().setup(trainer, pl_module, stage)
