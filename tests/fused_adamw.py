"""A callback for tests that start train.py on the CPU: LitLM's AdamW is fused there too (by default it is fused
only on CUDA), so that the CPU tests reach the paths of the fused optimizer, such as clipping inside its step."""

from __future__ import annotations

import lightning.pytorch as L

import lm_systems.training.optim


class FusedAdamWOnCPU(L.Callback):
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Before configure_optimizers, per process.
        lm_systems.training.optim.fused_adamw_possible = lambda param_groups: True
