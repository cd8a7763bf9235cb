"""The non-finite guard: its bookkeeping, and LitLM stopping or skipping non-finite steps against a reference run."""

from pathlib import Path

import lightning.pytorch as L
import pytest
import torch

from lm_systems.data.datamodule import LMDataModule
from lm_systems.lit_module import LitLM
from lm_systems.nonfinite import NonFiniteGuard, NonFiniteTrainingError

NAN, ONE = torch.tensor(float("nan")), torch.tensor(1.0)


def test_stop_reports_the_first_bad_step():
    guard = NonFiniteGuard("stop")
    for step, loss in enumerate([ONE, ONE, NAN, ONE, NAN]):
        guard.observe(step, loss, None)
    with pytest.raises(NonFiniteTrainingError, match="optimizer step 2:.*--model.lr"):
        guard.check("Lower --model.lr")


def test_skip_counts_and_stops_only_after_a_run_of_bad_steps():
    guard = NonFiniteGuard("skip", max_consecutive_skips=3)
    flags = [bool(guard.observe(step, ONE, norm)) for step, norm in enumerate([ONE, NAN, NAN, ONE, torch.tensor(float("inf"))])]
    assert flags == [False, True, True, False, True]
    guard.check("advice")  # at most two in a row: training goes on
    assert int(guard.skipped_steps) == 3
    guard.observe(5, NAN, None)
    guard.observe(6, NAN, None)
    with pytest.raises(NonFiniteTrainingError, match="3 optimizer steps in a row.*max_consecutive_skips 3"):
        guard.check("advice")


@pytest.mark.parametrize("policy, limit", [("sideways", 1), ("stop", 0)])
def test_bad_options_name_the_flag(policy, limit):
    with pytest.raises(ValueError, match="--model.on_nonfinite|--model.max_consecutive_skips"):
        NonFiniteGuard(policy, limit)


class _PoisonedLM(LitLM):
    """Its loss is NaN on the given optimizer steps."""

    def __init__(self, poisoned: set[int], **kwargs) -> None:
        super().__init__(**kwargs)
        self.poisoned = poisoned

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        loss = super()._loss(batch)
        return loss * float("nan") if self.training and self.trainer.global_step in self.poisoned else loss


MODEL = dict(size="tiny", d_model=32, num_layers=1, num_heads=2, d_ff=64, context_length=16, warmup_steps=2,
             sample_prompt="", lr=1e-2)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data_cache")


def fit(cache_dir: Path, poisoned: set[int], steps: int, log_every_n_steps: int = 2, **model) -> _PoisonedLM:
    L.seed_everything(0)
    module = _PoisonedLM(poisoned, **{**MODEL, **model})
    data = LMDataModule(cache_dir=str(cache_dir), generated_stories=300, vocab_size=300, context_length=16, batch_size=2)
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        log_every_n_steps=log_every_n_steps, gradient_clip_val=1.0)
    trainer.fit(module, datamodule=data)
    return module


def test_skipped_steps_leave_weights_and_optimizer_untouched(cache_dir):
    """With steps 2 and 3 skipped, the run ends with finite weights, and AdamW counts two fewer updates."""
    module = fit(cache_dir, {2, 3}, steps=6, on_nonfinite="skip")
    assert all(torch.isfinite(p).all() for p in module.parameters())
    optimizer = module.trainer.optimizers[0]
    assert {int(state["step"]) for state in optimizer.state.values()} == {4}
    assert int(module._nonfinite.skipped_steps) == 2


def test_stop_raises_at_the_next_logged_step_naming_the_step(cache_dir):
    with pytest.raises(NonFiniteTrainingError, match="optimizer step 2:"):
        fit(cache_dir, {2}, steps=8, on_nonfinite="stop")


def test_skip_stops_at_exactly_the_limit_between_logged_steps(cache_dir):
    """--model.max_consecutive_skips 3 with a log every 10 steps: the run stops after the third bad step in a row,
    not at the next logged step (which had let it run to 8)."""
    with pytest.raises(NonFiniteTrainingError, match=r"^3 optimizer steps in a row"):
        fit(cache_dir, set(range(2, 40)), steps=40, log_every_n_steps=10, on_nonfinite="skip", max_consecutive_skips=3)


def test_check_due_only_when_the_limit_may_have_been_reached():
    guard = NonFiniteGuard("skip", max_consecutive_skips=4)
    due = []
    for step, loss in enumerate([ONE, ONE, ONE, ONE, NAN, NAN, ONE, ONE]):
        guard.observe(step, loss)
        due.append(guard.check_due())
        if due[-1]:
            guard.check("advice")
    # First check after 4 steps (run 0); the next no sooner than 4 - 0 steps later, then 4 - 0 again.
    assert due == [False, False, False, True, False, False, False, True]
    assert not NonFiniteGuard("stop").check_due()
