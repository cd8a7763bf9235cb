"""StepTimer: files and logged scalars, and each phase charged to the right hooks (a fake clock that only
the model's hooks advance, by known amounts)."""

from __future__ import annotations

import csv
import json
import statistics
import time

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tiny_training import RandomTokenLM, fit

from callbacks import StepTimer

# Seconds each phase's hook adds to the clock; the timer must charge each to its own phase, exactly.
PHASE_S = {"forward": 0.100, "backward": 0.150, "optimizer": 0.200}


class FakeClock:
    """Stands in for time.perf_counter: time passes only when ``advance`` says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(time, "perf_counter", fake)
    return fake


class ClockedLM(RandomTokenLM):
    """Advances the clock by a known time in the forward, the backward and the optimizer step."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.clock = clock

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.clock.advance(PHASE_S["forward"])
        return super().training_step(batch, batch_idx)

    def on_before_backward(self, loss: torch.Tensor) -> None:
        self.clock.advance(PHASE_S["backward"])  # the module's hook runs after the callback's: inside backward

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.clock.advance(PHASE_S["optimizer"])  # after the callback's hook: inside the optimizer phase


@pytest.mark.slow
def test_phases_measure_their_own_hooks_and_files_agree(tmp_path, clock):
    timer = StepTimer(warmup_steps=2, timed_steps=3)
    trainer = fit(ClockedLM(clock), [timer], tmp_path, max_steps=6)

    for phase, seconds in PHASE_S.items():
        assert timer.summary[phase]["mean_ms"] == pytest.approx(seconds * 1e3), phase
    assert timer.summary["step"]["mean_ms"] == pytest.approx(sum(PHASE_S.values()) * 1e3)

    log_dir = trainer.log_dir
    with open(f"{log_dir}/step_times_rank0.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [2, 3, 4]
    summary = json.loads(open(f"{log_dir}/step_times_rank0.json").read())
    assert summary["warmup_steps"] == 2
    for phase in PHASE_S:
        column = [float(r[f"{phase}_ms"]) for r in rows]
        assert summary["phases"][phase]["mean_ms"] == pytest.approx(statistics.fmean(column))
        assert summary["phases"][phase]["std_ms"] == pytest.approx(statistics.stdev(column))
    for r in rows:  # the phases are disjoint parts of the step, and nothing else advanced the clock
        parts = float(r["forward_ms"]) + float(r["backward_ms"]) + float(r["optimizer_ms"])
        assert parts == pytest.approx(float(r["step_ms"]))

    events = EventAccumulator(log_dir)
    events.Reload()
    logged = events.Scalars("step_time/optimizer_mean_ms")
    assert logged[-1].value == pytest.approx(timer.summary["optimizer"]["mean_ms"], rel=1e-5)


@pytest.mark.slow
def test_gradient_accumulation_sums_micro_batches(tmp_path, clock):
    timer = StepTimer(warmup_steps=1, timed_steps=2)
    fit(ClockedLM(clock), [timer], tmp_path, max_steps=3, accumulate_grad_batches=2)
    assert len(timer.records) == 2
    for phase, micro_batches in (("forward", 2), ("backward", 2), ("optimizer", 1)):  # one step per two
        assert timer.summary[phase]["mean_ms"] == pytest.approx(micro_batches * PHASE_S[phase] * 1e3), phase


@pytest.mark.slow
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
