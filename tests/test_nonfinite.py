"""The non-finite guard: its bookkeeping; LitLM skipping non-finite steps (plain and fused AdamW) against a plain
loop that drops those batches, or stopping; and under a GradScaler (16-mixed), gradients unscaled before their
norm and clipping, overflowing steps left to the scaler to skip."""

from __future__ import annotations

import contextlib
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision
from schedule_reference import expected_lr_factor

from lm_systems.data.datamodule import LMDataModule
from lm_systems.lit_module import LitLM
from lm_systems.model.transformer import TransformerLM
from lm_systems.training.nonfinite import NonFiniteGuard, NonFiniteTrainingError
from lm_systems.training.optim import adamw_param_groups

NAN, ONE = torch.tensor(float("nan")), torch.tensor(1.0)


def test_stop_reports_the_first_bad_step():
    guard = NonFiniteGuard("stop")
    for step, loss in enumerate([ONE, ONE, NAN, ONE, NAN]):
        guard.observe(step, loss, None)
    with pytest.raises(NonFiniteTrainingError, match="optimizer step 2:.*--model.lr"):
        guard.check("Lower --model.lr")


def test_skip_counts_and_stops_only_after_a_run_of_bad_steps():
    guard = NonFiniteGuard("skip", max_consecutive_skips=3)
    flags = [
        bool(guard.observe(step, ONE, norm))
        for step, norm in enumerate([ONE, NAN, NAN, ONE, torch.tensor(float("inf"))])
    ]
    assert flags == [False, True, True, False, True]
    guard.check("advice")  # at most two in a row: training goes on
    assert int(guard.skipped_steps) == 3
    guard.observe(5, NAN, None)
    guard.observe(6, NAN, None)
    with pytest.raises(NonFiniteTrainingError, match="3 optimizer steps in a row.*max_consecutive_skips 3"):
        guard.check("advice")


@pytest.mark.parametrize(
    "policy, limit, flag", [("sideways", 1, "--model.on_nonfinite"), ("stop", 0, "--model.max_consecutive_skips")]
)
def test_bad_options_name_the_flag(policy, limit, flag):
    with pytest.raises(ValueError, match=flag):
        NonFiniteGuard(policy, limit)


class _PoisonedLM(LitLM):
    """Its loss is NaN on the given optimizer steps; records its starting weights, every batch it trained on and each
    step's gradient norm (before clipping)."""

    def __init__(self, poisoned: set[int], **kwargs) -> None:
        super().__init__(**kwargs)
        self.poisoned = poisoned
        self.batches: list[torch.Tensor] = []
        self.grad_norms: list[float] = []

    def on_train_start(self) -> None:
        self.initial = {name: value.clone() for name, value in self.model.state_dict().items()}

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.batches.append(batch.clone())
        return super().training_step(batch, batch_idx)

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        loss = super()._loss(batch)
        return loss * float("nan") if self.training and self.trainer.global_step in self.poisoned else loss

    def _clip_grad_norm(self, max_norm: float, in_step: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        norm, divisor = super()._clip_grad_norm(max_norm, in_step)
        self.grad_norms.append(norm.item())
        return norm, divisor


# The plain loss, as the plain loops below compute it: the fused loss sums in another order, which AdamW turns into
# moves above these bounds for weights whose gradient is near zero.
MODEL = dict(
    size="tiny",
    d_model=32,
    num_layers=1,
    num_heads=2,
    d_ff=64,
    context_length=16,
    warmup_steps=2,
    sample_prompt="",
    lr=1e-2,
    fused_loss=False,
)
CLIP = 1.0


def fit(
    cache_dir: Path, poisoned: set[int], steps: int, log_every_n_steps: int = 2, plugins=(), **model
) -> _PoisonedLM:
    L.seed_everything(0)
    module = _PoisonedLM(poisoned, **{**MODEL, **model})
    data = LMDataModule(
        cache_dir=str(cache_dir), generated_stories=300, vocab_size=300, context_length=16, batch_size=2
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        log_every_n_steps=log_every_n_steps,
        gradient_clip_val=CLIP,
        plugins=list(plugins),
    )
    trainer.fit(module, datamodule=data)
    return module


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """LitLM's AdamW fused on the CPU too (fused AdamW skips its update on the device when told ``found_inf``)."""
    monkeypatch.setattr("lm_systems.training.optim.fused_adamw_possible", lambda param_groups: True)


def dropping_the_poisoned_batches(module: _PoisonedLM, fused: bool) -> dict[str, torch.Tensor]:
    """The run's training in a plain loop from its starting weights, without the poisoned steps' batches: no update
    there, while the learning-rate schedule moves on (as it does for a skipped step)."""
    hparams, steps = module.hparams, module.trainer.max_steps
    model = TransformerLM(module.config)
    model.load_state_dict(module.initial)
    optimizer = torch.optim.AdamW(
        adamw_param_groups(model, hparams.weight_decay), lr=hparams.lr, betas=tuple(hparams.betas), fused=fused
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: expected_lr_factor(step, hparams.warmup_steps, steps, hparams.min_lr_ratio)
    )
    assert len(module.batches) == steps
    for step, batch in enumerate(module.batches):
        if step not in module.poisoned:
            logits = model(batch[:, :-1])  # (B, T, V)
            F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten()).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    return model.state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "fused_adamw"])
def test_skipped_steps_are_the_run_without_their_batches(cache_dir, fused, request):
    """Steps 2 and 3 poisoned: the weights end where a loop that never trained on those batches ends, and AdamW
    counts two fewer updates. Plain AdamW drops the gradients (one host sync); fused AdamW is told ``found_inf``."""
    if fused:
        request.getfixturevalue("fused_on_cpu")
    module = fit(cache_dir, {2, 3}, steps=6, on_nonfinite="skip")
    optimizer = module.trainer.optimizers[0]
    assert optimizer.defaults["fused"] is fused
    assert int(module._nonfinite.skipped_steps) == 2
    assert {int(state["step"]) for state in optimizer.state.values()} == {4}
    expected = dropping_the_poisoned_batches(module, fused)
    for name, weight in module.model.state_dict().items():
        torch.testing.assert_close(
            weight, expected[name], rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.slow
def test_fused_adamw_clips_inside_its_step_as_clipping_first_does(cache_dir, fused_on_cpu):
    """Fused AdamW divides the gradients by max(1, norm / clip) in its own update (no pass of its own to scale
    them): the weights end where torch's clip_grad_norm_ and a plain AdamW take them, every step clipping."""
    module = fit(cache_dir, set(), steps=4)
    optimizer = module.trainer.optimizers[0]
    assert optimizer.defaults["fused"] and min(module.grad_norms) > CLIP, "every step clips"
    assert optimizer.grad_scale == pytest.approx(module.grad_norms[-1] / CLIP, rel=1e-5), "the last step's divisor"
    expected = dropping_the_poisoned_batches(module, fused=False)
    for name, weight in module.model.state_dict().items():
        torch.testing.assert_close(
            weight, expected[name], rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.slow
def test_stop_raises_at_the_next_logged_step_naming_the_step(cache_dir):
    with pytest.raises(NonFiniteTrainingError, match="optimizer step 2:"):
        fit(cache_dir, {2}, steps=8, on_nonfinite="stop")


@pytest.mark.slow
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


def sixteen_mixed(**scaler) -> MixedPrecision:
    """16-mixed on the CPU: Lightning turns the flag into bf16-mixed there, but takes the plugin as given."""
    return MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", **scaler))


@pytest.mark.slow
def test_under_a_grad_scaler_the_norm_and_clipping_see_unscaled_gradients(cache_dir, fused_on_cpu, monkeypatch):
    """Fused AdamW would unscale inside step(), after clipping: LitLM unscales first. A run scaled by 2**12 then
    measures and clips the gradients of a run whose scaler does nothing: the same norms, the same weights.

    Autocast is off in both (the plugin's forward context emptied), so that the scaler is their only difference:
    scaling float32 gradients by a power of two and back is exact, where fp16 gradients of the unscaled run would
    underflow (which is what the scaler is for). Clipping the scaled gradients instead would shrink every update
    by 2**12 against AdamW's eps and report norms 2**12 times too large."""
    monkeypatch.setattr(MixedPrecision, "forward_context", lambda self: contextlib.nullcontext())
    scaled = fit(cache_dir, set(), steps=4, plugins=[sixteen_mixed(init_scale=2.0**12)])
    unscaled = fit(cache_dir, set(), steps=4, plugins=[sixteen_mixed(enabled=False)])
    assert scaled.trainer.precision_plugin.scaler.get_scale() == 2.0**12, "no step overflowed"
    assert min(unscaled.grad_norms) > CLIP, "every step clips"
    assert scaled.grad_norms == pytest.approx(unscaled.grad_norms, rel=1e-6)
    for (name, weight), other in zip(
        scaled.model.state_dict().items(), unscaled.model.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(weight, other, rtol=1e-6, atol=1e-8, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.slow
def test_under_a_grad_scaler_an_overflowing_step_is_the_scalers_to_skip(cache_dir, fused_on_cpu):
    """A scale of 2**24 overflows fp16 in the first backward: the scaler skips that step and backs off; the
    non-finite guard, set to stop, lets it (the loss was finite), and AdamW counts one update fewer."""
    module = fit(
        cache_dir,
        set(),
        steps=4,
        plugins=[sixteen_mixed(init_scale=2.0**24, backoff_factor=2.0**-10)],
        on_nonfinite="stop",
    )
    assert module.trainer.precision_plugin.scaler.get_scale() == 2.0**14
    assert {int(state["step"]) for state in module.trainer.optimizers[0].state.values()} == {3}
    assert all(torch.isfinite(p).all() for p in module.parameters())
