"""StepTimer: files and logged scalars, and each phase charged to the right hooks (known sleeps)."""

from __future__ import annotations

import csv
import json
import statistics
import time

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from callbacks import StepTimer
from tests.callbacks.tiny_training import RandomTokenLM, fit

# Sleeps put into each phase; the timer must charge each to its own phase.
SLEEP_S = {"forward": 0.10, "backward": 0.15, "optimizer": 0.20}
# Sleeps never end early. The slack covers the tiny model's own compute on two busy cores and stays
# under the smallest sleep, so a sleep charged to the wrong phase fails.
SLACK_S = 0.09


class SleepyLM(RandomTokenLM):
    """Sleeps a known time in the forward, the backward and the optimizer step."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        time.sleep(SLEEP_S["forward"])
        return super().training_step(batch, batch_idx)

    def on_before_backward(self, loss: torch.Tensor) -> None:
        time.sleep(SLEEP_S["backward"])  # the module's hook runs after the callback's: inside backward

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        time.sleep(SLEEP_S["optimizer"])  # after the callback's hook: inside the optimizer phase


def test_phases_measure_their_own_hooks_and_files_agree(tmp_path):
    timer = StepTimer(warmup_steps=2, timed_steps=3)
    trainer = fit(SleepyLM(), [timer], tmp_path, max_steps=6)

    for phase, sleep in SLEEP_S.items():
        mean = timer.summary[phase]["mean_ms"] / 1e3
        assert sleep <= mean < sleep + SLACK_S, (phase, mean)
    assert timer.summary["step"]["mean_ms"] / 1e3 >= sum(SLEEP_S.values())

    log_dir = trainer.log_dir
    with open(f"{log_dir}/step_times_rank0.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [2, 3, 4]
    summary = json.loads(open(f"{log_dir}/step_times_rank0.json").read())
    assert summary["warmup_steps"] == 2
    for phase in SLEEP_S:
        column = [float(r[f"{phase}_ms"]) for r in rows]
        assert summary["phases"][phase]["mean_ms"] == pytest.approx(statistics.fmean(column))
        assert summary["phases"][phase]["std_ms"] == pytest.approx(statistics.stdev(column))
    for r in rows:  # the phases are disjoint parts of the step
        assert float(r["forward_ms"]) + float(r["backward_ms"]) + float(r["optimizer_ms"]) <= float(r["step_ms"])

    events = EventAccumulator(log_dir)
    events.Reload()
    logged = events.Scalars("step_time/optimizer_mean_ms")
    assert logged[-1].value == pytest.approx(timer.summary["optimizer"]["mean_ms"], rel=1e-5)


def test_gradient_accumulation_sums_micro_batches(tmp_path):
    timer = StepTimer(warmup_steps=1, timed_steps=2)
    fit(SleepyLM(), [timer], tmp_path, max_steps=3, accumulate_grad_batches=2)
    assert len(timer.records) == 2
    forward = timer.summary["forward"]["mean_ms"] / 1e3
    assert 2 * SLEEP_S["forward"] <= forward < 2 * SLEEP_S["forward"] + SLACK_S
    optimizer = timer.summary["optimizer"]["mean_ms"] / 1e3  # one optimizer step per two micro-batches
    assert SLEEP_S["optimizer"] <= optimizer < SLEEP_S["optimizer"] + SLACK_S


def test_short_run_warns_and_writes_what_it_timed(tmp_path):
    timer = StepTimer(warmup_steps=1, timed_steps=10)
    with pytest.warns(UserWarning, match="timed 2 of 10 steps"):
        trainer = fit(RandomTokenLM(), [timer], tmp_path, max_steps=3)
    assert timer.summary["step"]["steps"] == 2
    assert (tmp_path / "run" / "version_0" / "step_times_rank0.json").is_file()
    assert trainer.log_dir == str(tmp_path / "run" / "version_0")


@pytest.mark.parametrize("kwargs, flag", [({"warmup_steps": -1}, "warmup_steps"), ({"timed_steps": 0}, "timed_steps")])
def test_bad_arguments_name_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        StepTimer(**kwargs)
