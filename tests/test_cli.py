"""train.py's command line: help, short flags, a short run with TensorBoard and checkpoints, every shipped
config, the configured callbacks, every strategy on two CPU processes, and errors that name the flag."""

import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.cli import LightningCLI
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from callbacks import StepsProgressBar
from lm_systems.cli import main
from lm_systems.data.datamodule import LMDataModule
from lm_systems.lit_module import LitLM

REPO = Path(__file__).resolve().parents[1]
FAST = ["--model.d_model", "64", "--model.num_layers", "1", "--model.num_heads", "2", "--model.d_ff", "128",
        "--model.context_length", "32", "--model.sample_tokens", "8", "--data.generated_stories", "1500",
        "--data.vocab_size", "400", "--data.batch_size", "4", "--data.val_batches", "2", "--trainer.enable_progress_bar", "false", "--trainer.log_every_n_steps", "1"]


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


@pytest.mark.slow
def test_help_lists_the_short_flags(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}  # the help cache (lm_systems.help_cache) stays in tmp
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "--help"], capture_output=True, text=True, cwd=REPO,
                         env=env, check=True).stdout
    for flag in ("--strategy", "--precision", "--devices", "--max_steps", "--checkpointing_interval", "--model.size", "--data.corpus", "--ckpt_path"):
        assert flag in out


def test_short_run_logs_to_tensorboard_checkpoints_and_resumes(tmp_path, capsys):
    cli = main([*FAST, "--max_steps", "6", "--trainer.val_check_interval", "3", "--checkpointing_interval", "4", "--precision", "bf16-mixed"])
    assert cli.trainer.global_step == 6 and cli.trainer.precision == "bf16-mixed"
    log_dir = Path(cli.trainer.logger.log_dir)
    events = EventAccumulator(str(log_dir)).Reload()
    for tag in ("val/loss", "val/perplexity", "train/loss", "train/lr/decay", "train/lr/no_decay", "train/grad_norm",
                "train/device/items_per_sec"):
        assert tag in events.Tags()["scalars"], tag
    assert [e.step for e in events.Scalars("val/loss")] == [2, 5]
    ckpts = sorted(p.name for p in (log_dir / "checkpoints").iterdir())
    assert ckpts == ["last.ckpt", "step=4.ckpt", "step=6.ckpt"]
    assert "Sample after 6 steps" in capsys.readouterr().out

    resumed = main([*FAST, "--max_steps", "8", "--ckpt_path", str(log_dir / "checkpoints" / "step=6.ckpt")])
    assert resumed.trainer.global_step == 8


def test_config_file_and_print_config(capsys):
    with pytest.raises(SystemExit):
        main(["-c", str(REPO / "configs" / "small.yaml"), "--print_config"])
    out = capsys.readouterr().out
    assert "size: small" in out and "max_steps: 5000" in out and "precision: bf16-mixed" in out


@pytest.mark.parametrize("config", sorted(str(p.relative_to(REPO / "configs")) for p in (REPO / "configs").rglob("*.yaml")))
def test_every_shipped_config_parses(config, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["-c", str(REPO / "configs" / config), "--print_config"])
    assert exit_.value.code in (0, None)
    out = capsys.readouterr().out
    assert "model:" in out
    if config.startswith("strategies/"):
        assert "class_path: strategies." in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model.size", "huge"], "--model.size"),
        (["--model.attention", "nope"], "--model.attention"),
        (["--model.num_heads", "3"], "model.num_heads"),
        (["--data.corpus", "missing.txt"], "--data.corpus"),
        (["--ckpt_path", "missing.ckpt"], "--ckpt_path"),
    ],
)
def test_bad_input_names_the_flag(args, message, capsys):
    with pytest.raises((ValueError, FileNotFoundError, SystemExit)) as error:
        main([*FAST, "--max_steps", "1", *args])
    if error.type is SystemExit:  # jsonargparse printed the usage (which lists every flag), then the error
        assert error.value.code == 2
        (said,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    else:
        said = str(error.value)
    assert message in said


def test_empty_corpus_names_the_flag(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(SystemExit):  # a usage error, as for a value of the wrong type
        main([*FAST, "--max_steps", "1", "--data.corpus", str(tmp_path / "empty.txt")])
    assert "--data.corpus" in capsys.readouterr().err.strip().splitlines()[-1]


def test_train_py_uses_the_steps_progress_bar():
    pytest.importorskip("rich")  # not a dependency: without it Lightning's default bar is tqdm, left in place
    cli = main([*FAST, "--max_steps", "1", "--trainer.enable_progress_bar", "true", "--trainer.limit_val_batches", "0"])
    assert isinstance(cli.trainer.progress_bar_callback, StepsProgressBar)


PROFILING_CALLBACKS = {"StepTimer", "MFUMonitor", "MemorySnapshot", "NVTXRanges"}
PROFILING_ARGS = ["-c", str(REPO / "configs/profiling.yaml"), "--trainer.accelerator", "cpu", "--trainer.logger", "false"]


def test_profiling_config_builds_every_callback_and_the_profiler():
    cli = LightningCLI(LitLM, LMDataModule, run=False, save_config_callback=None, args=PROFILING_ARGS)
    assert PROFILING_CALLBACKS <= {type(c).__name__ for c in cli.trainer.callbacks}
    assert type(cli.trainer.profiler).__name__ == "PyTorchProfiler"
    assert cli.trainer.profiler._profiler_kwargs["profile_memory"] is True


def test_train_py_keeps_the_configured_callbacks(monkeypatch):
    monkeypatch.setattr(L.Trainer, "fit", lambda *args, **kwargs: None)  # build everything, train nothing
    cli = main(["fit", *PROFILING_ARGS])
    assert PROFILING_CALLBACKS | {"StepCheckpoint", "CrashCheckpoint", "GCFreeze"} <= {type(c).__name__ for c in cli.trainer.callbacks}


TINY = ["--model.d_model", "32", "--model.num_layers", "1", "--model.num_heads", "2", "--model.d_ff", "64",
        "--model.context_length", "16", "--model.sample_prompt", "", "--data.generated_stories", "300",
        "--data.vocab_size", "300", "--data.batch_size", "2", "--data.val_batches", "1",
        "--trainer.val_check_interval", "2", "--trainer.enable_progress_bar", "false", "--trainer.logger", "false"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """Corpus and tokenizer built by the first two-process run, reused by the others."""
    return tmp_path_factory.mktemp("data_cache")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["naive_ddp", "overlap_ddp", "bucketed_ddp", "zero1", "zero3"])
def test_train_py_runs_on_two_cpu_processes(strategy, tmp_path, cache_dir):
    """Lightning's popen launcher re-runs the script once per extra process, so this goes through a subprocess."""
    command = [sys.executable, str(REPO / "train.py"), "--strategy", strategy, "--accelerator", "cpu", "--devices",
               "2", "--max_steps", "3", *TINY, "--data.cache_dir", str(cache_dir)]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "`Trainer.fit` stopped: `max_steps=3` reached" in done.stdout + done.stderr
    (checkpoint,) = tmp_path.rglob("step=3.ckpt")
    saved = torch.load(checkpoint, weights_only=False)
    trainable = sum(1 for k in saved["state_dict"] if k.startswith("model."))
    (optimizer_state,) = saved["optimizer_states"]
    # zero1 too: one consolidated state with every parameter's AdamW moments.
    assert len(optimizer_state["state"]) == trainable
