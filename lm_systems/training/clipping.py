"""Clipping by the global gradient norm, for every strategy and precision, with the non-finite watch on the norm.

The norm comes from one seam, :class:`lm_systems.training.strategy_offers.GlobalGradNorm`: the strategy's where it
offers one (its ranks hold different gradients), else torch's over the module's parameters. Done here rather than by
Lightning's precision plugin, which refuses to clip for an optimizer that unscales inside ``step()`` (fused AdamW),
even under bf16-mixed where nothing is scaled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import lightning.pytorch as L
import torch

from lm_systems.compat.lightning import logs_this_step
from lm_systems.compat.torch import can_scale_in_step, scale_in_step, skip_step_on_device, unscales_in_step
from lm_systems.errors import InputError
from lm_systems.training.nonfinite import NonFiniteGuard
from lm_systems.training.strategy_offers import GlobalGradNorm, LocalGradNorm

ClipFn = Callable[[float, bool], tuple[torch.Tensor, Optional[torch.Tensor]]]
"""``(max_norm, in_step)`` → the norm before clipping and the divisor left for the step (see ``clip_grad_norm``)."""


def global_grad_norm(trainer: L.Trainer, module: torch.nn.Module) -> GlobalGradNorm:
    """The strategy's global norm where it offers one, else torch's over ``module``'s parameters."""
    strategy = trainer.strategy
    return strategy if isinstance(strategy, GlobalGradNorm) else LocalGradNorm(module.parameters())


def clip_grad_norm(
    norms: GlobalGradNorm, max_norm: float, in_step: bool
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Scale the gradients to a global norm of at most ``max_norm``: the norm before clipping, and None.

    ``in_step`` (the optimizer ``can_scale_in_step``): the gradients are left as they are, and the divisor
    ``max(1, norm / max_norm)`` is returned for the step to apply inside the update's own pass over them (one read and
    write of every gradient fewer than scaling them first).
    """
    if not in_step:
        return norms.clip_grad_norm_(max_norm), None
    total = norms.grad_norm()
    # torch's clip_grad_norm_ multiplies by min(1, max_norm / (norm + 1e-6)): the same, as a divisor.
    return total, ((total.float() + 1e-6) / max_norm).clamp_(min=1.0)


class GradientClipping:
    """Each optimizer step: clip the gradients at the configured norm, have ``guard`` watch the step's loss and the
    norm, and under its "skip" policy drop a non-finite step's update."""

    def __init__(self, guard: NonFiniteGuard) -> None:
        self.guard = guard
        self.last_loss: Optional[torch.Tensor] = None  # this step's, set by the training step

    def __call__(
        self,
        trainer: L.Trainer,
        optimizer: torch.optim.Optimizer,
        clip_val: Optional[float],
        algorithm: Any,
        clip: ClipFn,
    ) -> dict[str, torch.Tensor]:
        """Clip at ``clip_val`` (none: falsy) by ``clip``; what a logged step records of it: the norm before clipping
        and, under "skip", the steps skipped so far (under "stop" that would always read 0: the run stops instead)."""
        if clip_val and algorithm not in (None, "norm"):
            given = getattr(algorithm, "value", algorithm)  # Lightning passes its enum
            raise InputError(f"only clipping by norm is supported, got --trainer.gradient_clip_algorithm {given}")
        scaler, log_now = getattr(trainer.precision_plugin, "scaler", None), logs_this_step(trainer)
        if scaler is not None and unscales_in_step(optimizer):
            # 16-mixed: the optimizer would unscale in step(); the norm needs it now, and a sharding scaler agrees on
            # overflow across ranks only in unscale_.
            scaler.unscale_(optimizer)
        # Else fused AdamW can clip inside its step.
        clips_in_step = scaler is None and can_scale_in_step(optimizer)
        grad_norm = divisor = None
        if clip_val or log_now or self.guard.policy == "skip":
            grad_norm, divisor = clip(clip_val or float("inf"), clips_in_step)
        if clips_in_step:
            scale_in_step(optimizer, divisor)  # set, or cleared, every step: none keeps another's
        # Under a GradScaler, overflowing gradients are the scaler's to skip; the loss is still ours to watch.
        bad = self.guard.observe(trainer.global_step, self.last_loss, grad_norm if scaler is None else None)
        if self.guard.policy == "skip" and scaler is None:
            _skip_update_if(bad, optimizer)
        if not log_now or grad_norm is None:
            return {}
        skipped = {"train/skipped_steps": self.guard.skipped_steps.float()} if self.guard.policy == "skip" else {}
        return {"train/grad_norm": grad_norm, **skipped}


def _skip_update_if(bad: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
    if unscales_in_step(optimizer):
        skip_step_on_device(optimizer, bad)  # fused AdamW skips its update on the device: no host sync
    elif bad:  # other optimizers: one host sync; parameters without gradients are not updated
        optimizer.zero_grad(set_to_none=True)
