"""Non-finite values in training: NonFiniteGuard notices non-finite losses and gradient norms without a host sync on the
steps that are fine (:mod:`lm_systems.run_callbacks.nonfinite_watch`'s NonFiniteWatch reads its record during
training); ``weights_are_finite`` is the check before a checkpoint is written."""

from __future__ import annotations

import math
from typing import Iterable, Literal, Optional

import torch

from lm_systems.errors import RunError

NonFinitePolicy = Literal["stop", "skip"]
NONFINITE_POLICIES = ("stop", "skip")


def divergence_advice(lr: Optional[float] = None) -> str:
    """What to change after training diverged, naming the flags (and the learning rate in use, when given)."""
    now = f" (now {lr:g})" if lr is not None else ""
    return (
        f"lower --model.lr{now}, keep gradient clipping on (--trainer.gradient_clip_val 1.0), "
        "and prefer --precision bf16-mixed to 16-mixed"
    )


class NonFiniteTrainingError(RunError):
    """Training produced a non-finite loss or gradient norm and was stopped."""


class NonFiniteWeightsError(RunError):
    """A checkpoint was not written because the weights hold NaN or inf."""

    def __init__(self, step: int) -> None:
        super().__init__(
            f"the weights are not finite (NaN or inf) at step {step}: no checkpoint of them was written and the "
            f"previous checkpoints (last.ckpt included) are kept. Training diverged: {divergence_advice()}"
        )


def weights_are_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """True when no floating-point tensor holds NaN or inf: one fused max-abs pass per device and dtype, one sync."""
    floating = [t.detach() for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()]
    # The inf-norm is a max |x|: it never overflows, and NaN propagates through it.
    return bool(torch.nn.utils.get_total_norm(floating, norm_type=math.inf, foreach=True).isfinite())


class NonFiniteGuard:
    """Device-side record of the optimizer steps whose loss or gradient norm was not finite.

    ``observe`` only queues device work and returns the step's "bad" flag (a 0-dim bool tensor);
    ``check`` reads the record (one host sync) and raises ``NonFiniteTrainingError`` when training
    must stop: under ``"stop"`` at the first bad step, under ``"skip"`` (the caller drops bad steps'
    updates) once ``max_consecutive_skips`` bad steps came in a row. ``check_due`` says when a check is needed
    for that limit to stop the run at exactly its length.
    """

    def __init__(self, policy: NonFinitePolicy = "stop", max_consecutive_skips: int = 10) -> None:
        if policy not in NONFINITE_POLICIES:
            raise ValueError(f"--model.on_nonfinite must be one of {NONFINITE_POLICIES}, got {policy!r}")
        if max_consecutive_skips < 1:
            raise ValueError(f"--model.max_consecutive_skips must be >= 1, got {max_consecutive_skips}")
        self.policy = policy
        self.max_consecutive_skips = max_consecutive_skips
        self._first_bad_step: Optional[torch.Tensor] = None  # -1 until a bad step is seen
        self._skipped = self._run = None  # bad steps in all, and in the current run of them
        self._observed = 0  # steps observed, counted on the host
        self._checked_at = self._run_at_check = 0  # steps observed and the run's length at the last check

    def observe(self, step: int, *values: Optional[torch.Tensor]) -> torch.Tensor:
        """Record optimizer step ``step`` from its scalar ``values`` (None entries are ignored)."""
        present = [v.detach().float() for v in values if v is not None]
        bad = ~torch.isfinite(torch.stack(present)).all()
        if self._first_bad_step is None:
            self._first_bad_step = torch.full((), -1, dtype=torch.int64, device=bad.device)
            self._skipped = torch.zeros((), dtype=torch.int64, device=bad.device)
            self._run = torch.zeros((), dtype=torch.int64, device=bad.device)
        first_seen = bad & (self._first_bad_step < 0)
        self._first_bad_step = torch.where(first_seen, step, self._first_bad_step)
        self._skipped = self._skipped + bad
        self._run = (self._run + 1) * bad
        self._observed += 1
        return bad

    def check_due(self) -> bool:
        """Whether, under ``"skip"``, the run of bad steps may have reached the limit since the last check: it grows
        by at most one a step, so not before ``max_consecutive_skips`` minus its length then steps have passed."""
        since = self._observed - self._checked_at
        return self.policy == "skip" and since > 0 and since >= self.max_consecutive_skips - self._run_at_check

    @property
    def skipped_steps(self) -> Optional[torch.Tensor]:
        """How many observed steps were bad (a device tensor), or None before the first step."""
        return self._skipped

    def check(self, advice: str) -> None:
        """Raise ``NonFiniteTrainingError`` (with ``advice`` appended) if training must stop."""
        if self._first_bad_step is None:
            return
        first_bad, run = int(self._first_bad_step), int(self._run)
        self._checked_at, self._run_at_check = self._observed, run
        if self.policy == "stop" and first_bad >= 0:
            raise NonFiniteTrainingError(
                f"the loss or gradient norm was not finite at optimizer step {first_bad}: training stopped, and no "
                f"checkpoint of the weights since then was written: {advice} (or pass --model.on_nonfinite skip)"
            )
        if self.policy == "skip" and run >= self.max_consecutive_skips:
            raise NonFiniteTrainingError(
                f"{run} optimizer steps in a row had a non-finite loss or gradient norm and were skipped "
                f"(limit --model.max_consecutive_skips {self.max_consecutive_skips}): training stopped: {advice}"
            )
