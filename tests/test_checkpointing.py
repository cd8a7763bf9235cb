"""Checkpoints: step files and last.ckpt as a link, never a file of non-finite weights, never a torn file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from random_windows import RandomWindowsLM

from lm_systems.files.checkpoint_io import SafeCheckpointIO
from lm_systems.run_callbacks.checkpoints import CrashCheckpoint, StepCheckpoint
from lm_systems.training.nonfinite import NonFiniteWeightsError

ADVICE = ("--model.lr", "--trainer.gradient_clip_val", "bf16-mixed")


class AtStep(L.Callback):
    """Runs ``action(module)`` once, after the optimizer step that makes ``trainer.global_step == step``."""

    def __init__(self, step: int, action) -> None:
        self.step, self.action = step, action

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if trainer.global_step == self.step:
            self.action(pl_module)


def poison(module: L.LightningModule) -> None:
    with torch.no_grad():
        next(module.parameters())[0, 1] = float("nan")


def fail(module: L.LightningModule) -> None:
    raise RuntimeError("planted failure")


def fit(
    tmp_path: Path,
    max_steps: int,
    interval: int,
    callbacks: tuple[L.Callback, ...] = (),
    ckpt_path: Path | None = None,
    **trainer_options,
) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*callbacks, StepCheckpoint(interval, dirpath=str(tmp_path)), CrashCheckpoint()],
        plugins=[SafeCheckpointIO()],
        **trainer_options,
    )
    trainer.fit(RandomWindowsLM(), ckpt_path=ckpt_path)
    return trainer


def step_of(path: Path) -> int:
    return torch.load(path, weights_only=False)["global_step"]


def test_step_files_every_interval_and_at_the_end_with_last_as_a_link(tmp_path):
    fit(tmp_path, max_steps=5, interval=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "step=2.ckpt", "step=4.ckpt", "step=5.ckpt"]
    last = tmp_path / "last.ckpt"
    assert last.is_symlink() and os.readlink(last) == "step=5.ckpt", "last.ckpt must link the newest file, not copy it"
    assert step_of(last) == 5


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_resumed_run_does_not_save_again_the_step_it_resumed_from(tmp_path, accumulate):
    """Its first micro-batch ends at the resumed step; accumulating, no optimizer step has moved it yet, and that
    step is the checkpoint the run started from: writing it again is a whole checkpoint's I/O for nothing."""
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    fit(first, max_steps=2, interval=2, accumulate_grad_batches=accumulate)
    fit(resumed, max_steps=4, interval=2, ckpt_path=first / "step=2.ckpt", accumulate_grad_batches=accumulate)
    assert sorted(p.name for p in resumed.iterdir()) == ["last.ckpt", "step=4.ckpt"]
    assert step_of(resumed / "step=4.ckpt") == 4


def killed_writer_pid() -> int:
    """The process id of a process that has ended (as a writer killed mid-save has)."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def test_the_next_run_removes_temporaries_of_killed_saves(tmp_path):
    runs = tmp_path / "lm_systems"
    killed = runs / "version_0" / "checkpoints" / f"step=4.ckpt.tmp-{killed_writer_pid()}-0a1b2c3d"
    writing = runs / "version_1" / "checkpoints" / f"step=2.ckpt.tmp-{os.getpid()}-0a1b2c3d"  # a live writer's
    recent = runs / "version_1" / "checkpoints" / f"step=3.ckpt.tmp-{killed_writer_pid()}-4e5f6a7b"
    for path in (killed, writing, recent):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"torn")
    an_hour_ago = time.time() - 3600
    for path in (killed, writing):
        os.utime(path, (an_hour_ago, an_hour_ago))
    fit(runs / "version_2" / "checkpoints", max_steps=1, interval=0)
    assert not killed.exists()
    assert writing.exists() and recent.exists(), "a live writer's file, or one written to a moment ago, must stay"


def test_non_finite_weights_stop_the_run_and_last_stays_the_good_checkpoint(tmp_path):
    with pytest.raises(NonFiniteWeightsError, match="step 4") as error:
        fit(tmp_path, max_steps=8, interval=2, callbacks=(AtStep(4, poison),))  # after step 4, before its save
    for advice in ADVICE:
        assert advice in str(error.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "step=2.ckpt"], "no crash.ckpt, no step=4.ckpt"
    state = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert state["global_step"] == 2
    assert all(t.isfinite().all() for t in state["state_dict"].values())


def test_an_exception_saves_crash_ckpt_and_keeps_last(tmp_path):
    with pytest.raises(RuntimeError, match="planted failure"):
        fit(tmp_path, max_steps=8, interval=2, callbacks=(AtStep(3, fail),))
    assert step_of(tmp_path / "crash.ckpt") == 3
    assert os.readlink(tmp_path / "last.ckpt") == "step=2.ckpt"


def test_an_exception_after_divergence_writes_no_crash_ckpt(tmp_path):
    with pytest.warns(UserWarning, match=r"could not save .*crash\.ckpt.*not finite.*step 3"):
        with pytest.raises(RuntimeError, match="planted failure"):
            fit(
                tmp_path, max_steps=8, interval=2, callbacks=(AtStep(3, lambda module: (poison(module), fail(module))),)
            )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "step=2.ckpt"]


def test_no_checkpoint_of_non_finite_weights_is_written_by_any_path(tmp_path):
    """The check is LitLM's, before any writer: a checkpoint asked for by hand is refused too."""
    trainer = fit(tmp_path, max_steps=2, interval=0)
    poison(trainer.lightning_module)
    for bad_path in (tmp_path / "by_hand.ckpt", tmp_path / "last.ckpt"):
        with pytest.raises(NonFiniteWeightsError, match="step 2"):
            trainer.save_checkpoint(bad_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "step=2.ckpt"], "no file, no temporary file"
    assert os.readlink(tmp_path / "last.ckpt") == "step=2.ckpt"


WRITER = textwrap.dedent("""
    import sys, torch
    from lm_systems.files.checkpoint_io import SafeCheckpointIO
    io, path = SafeCheckpointIO(), sys.argv[1]
    for step in range(1, 1000):
        io.save_checkpoint({"state_dict": {"w": torch.full((4_000_000,), float(step))}, "global_step": step}, path)
        print(step, flush=True)
""")


@pytest.mark.slow
def test_a_kill_during_saves_leaves_the_previous_checkpoint_loadable(tmp_path):
    """SIGKILL at several moments of a stream of 16 MB saves to one path: the file always loads, whole."""
    path = tmp_path / "last.ckpt"
    repo = Path(__file__).resolve().parents[1]
    for delay in (0.0, 0.03, 0.07, 0.15):
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(path)], cwd=repo, stdout=subprocess.PIPE, text=True
        )
        saved = int(writer.stdout.readline())  # the first save is complete
        time.sleep(delay)
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        saved = max([saved, *(int(line) for line in writer.stdout.read().split())])
        state = torch.load(path, weights_only=True)
        step = state["global_step"]
        assert step >= saved  # at least the last save it reported, maybe the one after, never a torn one
        assert torch.equal(state["state_dict"]["w"], torch.full((4_000_000,), float(step)))


class CtrlCWhenPickled:
    """Sends this process SIGINT while torch.save pickles it, after the tensors before it were written."""

    def __reduce__(self):
        os.kill(os.getpid(), signal.SIGINT)
        return (dict, ())


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_during_a_save_is_raised_after_the_file_is_whole(tmp_path, presses):
    """torch.save turned a Ctrl-C mid-write into a RuntimeError of its zip writer (CI saw exit 1, not 130).

    One press waits for the write and is raised after it; a second press raises at once and leaves no file."""
    path = tmp_path / "last.ckpt"
    state = {"state_dict": {"w": torch.arange(100_000.0)}, "interrupt": [CtrlCWhenPickled() for _ in range(presses)]}
    with pytest.raises(KeyboardInterrupt):
        SafeCheckpointIO().save_checkpoint(state, path)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if presses == 1:
        assert torch.equal(torch.load(path, weights_only=False)["state_dict"]["w"], torch.arange(100_000.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == (["last.ckpt"] if presses == 1 else [])
