"""TensorBoard after a resume tells the truth: every point of a resumed run sits at the step an uninterrupted run
puts it at, whichever checkpoint it resumed (mid-run, or the end of a fit that validated at its last step), and the
first learning rate it draws is the one that step trains with."""

from __future__ import annotations

from pathlib import Path

import pytest
from schedule_reference import expected_lr_factor
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from train import main

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:LightningCLI.s args parameter")]  # trains
WARMUP, LR = 2, 3e-3


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def fast(tiny_args) -> list[str]:
    """Logging every other step and validating every other step, as the default run's two intervals align; one
    schedule of 8 steps for runs stopped sooner (a longer --max_steps on resume would stretch the cosine)."""
    return [
        *tiny_args,
        "--trainer.log_every_n_steps",
        "2",
        "--trainer.val_check_interval",
        "2",
        "--trainer.enable_progress_bar",
        "false",
        "--model.warmup_steps",
        str(WARMUP),
        "--model.lr",
        str(LR),
        "--model.decay_steps",
        "8",
    ]


def points(cli) -> dict[str, list[tuple[int, float]]]:
    """Each scalar tag's (step, value) points in the run's TensorBoard folder."""
    events = EventAccumulator(str(cli.trainer.logger.log_dir)).Reload()
    return {
        tag: [(event.step, event.value) for event in events.Scalars(tag)]
        for tag in ("train/loss", "train/lr", "val/loss")
    }


@pytest.mark.parametrize("stop, interval", [(4, 0), (4, 2), (3, 0)], ids=["end-of-fit", "mid-run", "end-unvalidated"])
def test_a_resumed_runs_points_are_where_an_uninterrupted_run_puts_them(fast, stop, interval):
    first = main([*fast, "--max_steps", str(stop), "--checkpointing_interval", str(interval)])
    checkpoint = Path(first.trainer.logger.log_dir) / "checkpoints" / f"step={stop}.ckpt"
    resumed = main([*fast, "--max_steps", "8", "--ckpt_path", str(checkpoint)])
    straight = main([*fast, "--max_steps", "8"])
    after = {tag: [(step, value) for step, value in drawn if step >= stop] for tag, drawn in points(straight).items()}
    assert points(resumed) == after  # the same values too: resuming is exact


def test_the_first_rate_drawn_after_a_resume_is_the_one_trained_with(fast):
    first = main([*fast, "--max_steps", "4", "--trainer.log_every_n_steps", "1"])
    checkpoint = Path(first.trainer.logger.log_dir) / "checkpoints" / "step=4.ckpt"
    resumed = main(
        [
            *fast,
            "--max_steps",
            "8",
            "--trainer.log_every_n_steps",
            "1",
            "--model.lr",
            str(10 * LR),
            "--ckpt_path",
            str(checkpoint),
        ]
    )
    events = EventAccumulator(str(resumed.trainer.logger.log_dir)).Reload()
    drawn = [(event.step, event.value) for event in events.Scalars("train/lr")]
    expected = [(step, 10 * LR * expected_lr_factor(step, WARMUP, 8, 0.1)) for step in range(4, 8)]
    assert [step for step, _ in drawn] == [step for step, _ in expected]
    assert [value for _, value in drawn] == pytest.approx([value for _, value in expected], rel=1e-6)
