"""train.py fails safe: bad input is a short usage error naming the flag, SIGTERM exits non-zero after saving,
runs never share a folder, a resumed run can continue its own, and a configuration's own parts are kept."""

from __future__ import annotations

import os
import signal
import time
from contextlib import ExitStack
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.loggers import TensorBoardLogger

from callbacks.progress import StepsProgressBar, StepsTQDMProgressBar
from lm_systems.run.logger import RunLogger
from lm_systems.run_callbacks.checkpoints import CrashCheckpoint, StepCheckpoint
from train import main

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI.s args parameter")  # pytest's own argv
NO_VALIDATION = ["--trainer.limit_val_batches", "0", "--trainer.enable_model_summary", "false"]


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def fast(tiny_args) -> list[str]:
    """A tiny run without validation, in this process."""
    return [*tiny_args, *NO_VALIDATION]


@pytest.fixture
def usage_error(fast, capsys):
    def last_line(args: list[str]) -> str:
        """The last line of stderr of ``main(args)``, which must exit with 2 like a mistyped flag."""
        with pytest.raises(SystemExit) as exit_:
            main([*fast, *args])
        assert exit_.value.code == 2
        return capsys.readouterr().err.strip().splitlines()[-1]

    return last_line


# -- errors at the door ----------------------------------------------------------------------


def write_checkpoint(path: Path) -> Path:
    torch.save({"state_dict": {"w": torch.ones(100_000)}}, path)
    return path


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
            "is not a readable PyTorch checkpoint (truncated",
        ),
        (lambda p: p.write_bytes(b"\x00" * 64), "is not a readable PyTorch checkpoint"),
        (lambda p: (p.unlink(), p.mkdir()), "is a folder, not a checkpoint file"),
        (lambda p: p.unlink(), "does not exist"),
    ],
    ids=["truncated", "not-a-zip", "folder", "missing"],
)
def test_ckpt_path_is_checked_before_lightning_reads_it(tmp_path, usage_error, damage, message):
    path = write_checkpoint(tmp_path / "run.ckpt")
    damage(path)
    line = usage_error(["--ckpt_path", str(path)])
    assert f"--ckpt_path {str(path)!r} {message}" in line, line


@pytest.mark.parametrize(
    "args, names",
    [
        (["--precision", "8-bit"], ["--precision '8-bit' is not one of: ", "bf16-mixed", "16-mixed", "32-true"]),
        (["--trainer.precision", "8-bit"], ["--trainer.precision '8-bit' is not one of: ", "bf16-mixed"]),
        (["--model.activation_checkpointing", "all"], ["--model.activation_checkpointing 'all' is not one of: none"]),
        (["--strategy", "nonsense"], ["--strategy", "naive_ddp", "overlap_ddp", "bucketed_ddp", "zero1", "ddp"]),
        (["--trainer.strategy", "nonsense"], ["--trainer.strategy", "zero1"]),
        (["--accelerator", "abacus"], ["--accelerator", "cpu", "gpu", "auto"]),
        (["--model.attention", "bogus"], ["--model.attention", "flash_triton"]),
        (["--model.size", "huge"], ["--model.size", "small"]),
    ],
)
def test_bad_values_are_one_line_usage_errors_listing_the_valid_ones(args, names, usage_error):
    line = usage_error(args)
    assert line.startswith("error: ") and all(name in line for name in names), line


def test_the_user_sees_no_traceback(tmp_path, train_py):
    run = train_py.run("--precision", "8-bit", cwd=tmp_path, timeout=120)
    err = run.stderr
    assert run.returncode == 2
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 3, err
    assert "--precision '8-bit' is not one of: " in err


# -- SIGTERM, warnings ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_saves_crash_ckpt_and_exits_128_plus_its_number(tmp_path, signum, train_py):
    """SIGTERM exits 143 and Ctrl-C 130 (Lightning's own exit status for Ctrl-C is 1)."""
    checkpoints = tmp_path / "logs" / "lm_systems" / "version_0" / "checkpoints"
    with train_py.start(
        *train_py.tiny, *NO_VALIDATION, "--max_steps", "100000", "--checkpointing_interval", "1", cwd=tmp_path
    ) as run:  # killed on the way out if the test fails before it stops
        deadline = time.monotonic() + 240
        # last.ckpt is linked after step=1.ckpt is written: a Ctrl-C between the two would leave no last.ckpt
        while not (checkpoints / "last.ckpt").exists():
            assert run.poll() is None and time.monotonic() < deadline, "no last.ckpt"
            time.sleep(0.2)
        run.send_signal(signum)
        _, err = run.communicate(timeout=120)
    assert run.returncode == 128 + signum, err
    crash = torch.load(checkpoints / "crash.ckpt", weights_only=False)
    assert crash["global_step"] >= 1
    assert torch.load(checkpoints / "last.ckpt", weights_only=False)["global_step"] >= 1


def test_a_default_run_prints_no_avoidable_warning_or_tip(tmp_path, train_py):
    done = train_py.run_ok(
        *train_py.tiny,
        *NO_VALIDATION,
        "--max_steps",
        "2",
        "--model.sample_prompt",
        "Once upon a time",
        "--model.sample_tokens",
        "4",
        cwd=tmp_path,
    )
    out, err = done.stdout, done.stderr
    for text in ("Warning", "warn", "Tip", "weights_only", "deprecated"):
        assert text not in out + err, (text, out + err)
    last = tmp_path / "logs" / "lm_systems" / "version_0" / "checkpoints" / "last.ckpt"
    assert last.is_symlink() and os.readlink(last) == "step=2.ckpt"


def test_a_diverging_run_stops_non_zero_and_keeps_no_non_finite_checkpoint(tmp_path, train_py):
    """The issue's run: lr 1e6 turns the weights NaN within a few steps; the steps before are saved."""
    run = train_py.run(
        *train_py.tiny,
        *NO_VALIDATION,
        "--model.lr",
        "1e6",
        "--max_steps",
        "40",
        "--checkpointing_interval",
        "1",
        cwd=tmp_path,
    )
    err = run.stderr
    assert run.returncode != 0
    assert "--model.lr" in err and "--trainer.gradient_clip_val" in err, err[-3000:]
    assert "Traceback" not in err and "could not save" not in err, err[
        -3000:
    ]  # no crash.ckpt of diverged weights tried
    saved = list(tmp_path.rglob("*.ckpt"))
    assert any(path.name == "last.ckpt" for path in saved) and len(saved) >= 2
    for path in saved:
        state = torch.load(path, weights_only=False)["state_dict"]
        assert all(t.isfinite().all() for t in state.values() if t.is_floating_point()), path


# -- run folders ------------------------------------------------------------------------------


def test_loggers_racing_for_one_folder_claim_distinct_versions(tmp_path, monkeypatch):
    """Both read the folder before either created its version (what two runs started together do)."""
    monkeypatch.setattr(TensorBoardLogger, "_get_next_version", lambda self: 0)
    versions = [RunLogger(save_dir=str(tmp_path), name="runs").version for _ in range(3)]
    assert versions == [0, 1, 2]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["version_0", "version_1", "version_2"]


def test_two_runs_started_together_write_separate_folders(tmp_path, fast, train_py):
    main([*fast, "--max_steps", "1", "--trainer.enable_progress_bar", "false"])  # builds the shared data cache
    with ExitStack() as running:
        runs = [
            running.enter_context(
                train_py.start(
                    *train_py.tiny, *NO_VALIDATION, "--max_steps", "1", "--seed_everything", str(seed), cwd=tmp_path
                )
            )
            for seed in (1, 2)
        ]
        for run in runs:
            out, err = run.communicate(timeout=300)
            assert run.returncode == 0, err
    folders = sorted((tmp_path / "logs" / "lm_systems").iterdir())
    assert [f.name for f in folders] == ["version_0", "version_1", "version_2"]
    seeds = {(f / "config.yaml").read_text().split("seed_everything: ")[1].split()[0] for f in folders[1:]}
    assert seeds == {"1", "2"}
    assert all((f / "checkpoints" / "step=1.ckpt").is_file() for f in folders)


def test_default_root_dir_moves_the_runs(tmp_path, monkeypatch, fast):
    monkeypatch.setattr(L.Trainer, "fit", lambda *a, **k: None)  # build everything, train nothing
    cli = main([*fast, "--trainer.default_root_dir", str(tmp_path / "elsewhere")])
    assert Path(cli.trainer.logger.log_dir) == tmp_path / "elsewhere" / "logs" / "lm_systems" / "version_0"
    assert not (tmp_path / "logs").exists()


@pytest.mark.slow
def test_resume_into_run_continues_the_folder_and_the_bar_total(tmp_path, fast):
    first = main([*fast, "--max_steps", "4", "--checkpointing_interval", "2", "--trainer.enable_progress_bar", "false"])
    run_dir = Path(first.trainer.logger.log_dir).resolve()
    resumed = main(
        [
            *fast,
            "--max_steps",
            "6",
            "--ckpt_path",
            str(run_dir / "checkpoints" / "step=2.ckpt"),
            "--resume_into_run",
            "true",
            "--trainer.enable_progress_bar",
            "true",  # the first run's setting continues unless typed
        ]
    )
    assert Path(resumed.trainer.logger.log_dir).resolve() == run_dir
    assert sorted(p.name for p in run_dir.parent.iterdir()) == ["version_0"]
    assert os.readlink(run_dir / "checkpoints" / "last.ckpt") == "step=6.ckpt"
    bar = resumed.trainer.progress_bar_callback
    assert bar.total_train_batches == 6  # the whole run's, as the bar counts from its start
    if isinstance(bar, StepsTQDMProgressBar):
        assert (bar.train_progress_bar.n, bar.train_progress_bar.total) == (6, 6)


@pytest.mark.slow
def test_ckpt_path_last_resumes_the_newest_runs_last_ckpt(tmp_path, fast, assert_same_training_state):
    quiet = [*fast, "--trainer.enable_progress_bar", "false"]
    # Another seed than the resumed runs': a run from scratch would not match one resumed from these weights.
    main([*quiet, "--max_steps", "1", "--seed_everything", "7"])
    newer = main([*quiet, "--max_steps", "2", "--seed_everything", "7"])
    newest = Path(newer.trainer.logger.log_dir) / "checkpoints" / "last.ckpt"
    by_name = main([*quiet, "--max_steps", "3", "--ckpt_path", "last"])
    by_path = main([*quiet, "--max_steps", "3", "--ckpt_path", str(newest)])
    assert_same_training_state(
        *(
            torch.load(Path(cli.trainer.logger.log_dir) / "checkpoints" / "step=3.ckpt", weights_only=False)
            for cli in (by_name, by_path)
        )
    )


def test_ckpt_path_last_without_a_run_is_a_usage_error(tmp_path, usage_error):
    line = usage_error(["--ckpt_path", "last"])
    assert line.startswith("error: --ckpt_path last: no run checkpoint (logs/*/version_*/checkpoints/last.ckpt) under")


def test_resume_into_run_needs_a_run_folder_checkpoint(tmp_path, usage_error):
    path = write_checkpoint(tmp_path / "loose.ckpt")
    line = usage_error(["--ckpt_path", str(path), "--resume_into_run", "true"])
    assert "--resume_into_run needs a --ckpt_path inside" in line


def test_resume_into_run_needs_the_tensorboard_logger(tmp_path, usage_error):
    checkpoints = tmp_path / "logs" / "lm_systems" / "version_0" / "checkpoints"
    checkpoints.mkdir(parents=True)
    path = write_checkpoint(checkpoints / "step=2.ckpt")
    line = usage_error(
        [
            "--ckpt_path",
            str(path),
            "--resume_into_run",
            "true",
            "--trainer.logger",
            "lightning.pytorch.loggers.CSVLogger",
            "--trainer.logger.save_dir",
            "logs",
        ]
    )
    assert "--resume_into_run continues a TensorBoard run folder: leave --trainer.logger at its default" in line


# -- a configuration's own parts --------------------------------------------------------------


@pytest.fixture
def built_callbacks(monkeypatch, fast):
    def build(*args: str) -> list[L.Callback]:
        monkeypatch.setattr(L.Trainer, "fit", lambda *a, **k: None)  # build everything, train nothing
        return main([*fast, *args]).trainer.callbacks

    return build


def test_a_configured_model_checkpoint_and_progress_bar_are_kept(tmp_path, built_callbacks):
    config = tmp_path / "mine.yaml"
    config.write_text(
        "trainer:\n  callbacks:\n"
        "    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n      init_args: {every_n_train_steps: 7}\n"
        "    - class_path: lightning.pytorch.callbacks.TQDMProgressBar\n      init_args: {refresh_rate: 3}\n"
    )
    callbacks = built_callbacks("-c", str(config))
    checkpoints = [c for c in callbacks if isinstance(c, ModelCheckpoint)]
    bars = [c for c in callbacks if isinstance(c, TQDMProgressBar) or isinstance(c, StepsProgressBar)]
    assert [type(c) for c in checkpoints] == [ModelCheckpoint] and checkpoints[0]._every_n_train_steps == 7
    assert [type(c) for c in bars] == [TQDMProgressBar] and bars[0].refresh_rate == 3
    assert any(isinstance(c, CrashCheckpoint) for c in callbacks)


def test_the_default_checkpointing_follows_the_interval(built_callbacks):
    callbacks = built_callbacks("--checkpointing_interval", "5")
    [checkpoint] = [c for c in callbacks if isinstance(c, ModelCheckpoint)]
    assert isinstance(checkpoint, StepCheckpoint) and checkpoint._every_n_train_steps == 5
    assert checkpoint.save_last == "link"


def test_checkpointing_keep_keeps_the_newest_checkpoints_of_the_run(fast):
    cli = main([*fast, "--max_steps", "5", "--checkpointing_interval", "1", "--checkpointing_keep", "2"])
    folder = Path(cli.trainer.logger.log_dir) / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "step=4.ckpt", "step=5.ckpt"]
    assert os.readlink(folder / "last.ckpt") == "step=5.ckpt"


def test_a_negative_checkpointing_keep_is_a_usage_error(usage_error):
    assert usage_error(["--checkpointing_keep", "-1"]) == (
        "error: --checkpointing_keep must be 0 (keep every checkpoint) or more, got -1"
    )


def test_checkpointing_keep_beside_a_configured_model_checkpoint_is_a_usage_error(built_callbacks, capsys):
    with pytest.raises(SystemExit):
        built_callbacks("--trainer.callbacks+=ModelCheckpoint", "--checkpointing_keep", "2")
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--checkpointing_keep" in last and "save_top_k" in last


def test_an_interval_beside_a_configured_model_checkpoint_is_a_usage_error(built_callbacks, capsys):
    with pytest.raises(SystemExit):
        built_callbacks("--trainer.callbacks+=ModelCheckpoint", "--checkpointing_interval", "5")
    assert "--checkpointing_interval" in capsys.readouterr().err.strip().splitlines()[-1]
