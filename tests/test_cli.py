"""train.py's command line: help, short flags, a short run with TensorBoard and checkpoints, errors."""

import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lm_systems.cli import main

REPO = Path(__file__).resolve().parents[1]
FAST = ["--model.d_model", "64", "--model.num_layers", "1", "--model.num_heads", "2", "--model.d_ff", "128",
        "--model.context_length", "32", "--model.sample_tokens", "8", "--data.generated_stories", "1500",
        "--data.vocab_size", "400", "--data.batch_size", "4", "--data.val_batches", "2", "--trainer.enable_progress_bar", "false", "--trainer.log_every_n_steps", "1"]


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def test_help_lists_the_short_flags():
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "--help"], capture_output=True, text=True, cwd=REPO, check=True).stdout
    for flag in ("--strategy", "--precision", "--devices", "--max_steps", "--checkpointing_interval", "--model.size", "--data.corpus", "--ckpt_path"):
        assert flag in out


def test_short_run_logs_to_tensorboard_checkpoints_and_resumes(tmp_path, capsys):
    cli = main([*FAST, "--max_steps", "6", "--trainer.val_check_interval", "3", "--checkpointing_interval", "4", "--precision", "bf16-mixed"])
    assert cli.trainer.global_step == 6 and cli.trainer.precision == "bf16-mixed"
    log_dir = Path(cli.trainer.logger.log_dir)
    events = EventAccumulator(str(log_dir)).Reload()
    for tag in ("val/loss", "val/perplexity", "train/loss", "train/lr", "train/grad_norm"):
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


@pytest.mark.parametrize("config", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_every_shipped_config_parses(config, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["-c", str(REPO / "configs" / config), "--print_config"])
    assert exit_.value.code in (0, None)
    assert "model:" in capsys.readouterr().out


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
def test_bad_input_names_the_flag(args, message):
    with pytest.raises((ValueError, FileNotFoundError, SystemExit)) as error:
        main([*FAST, "--max_steps", "1", *args])
    assert message in str(error.value) or error.type is SystemExit


def test_empty_corpus_names_the_flag(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(SystemExit):  # a usage error, as for a value of the wrong type
        main([*FAST, "--max_steps", "1", "--data.corpus", str(tmp_path / "empty.txt")])
    assert "--data.corpus" in capsys.readouterr().err.strip().splitlines()[-1]


def test_progress_bar_has_no_negative_epoch_total():
    """Training by steps leaves max_epochs at -1; Lightning's rich bar read "Epoch 0/-2" there."""
    pytest.importorskip("rich")
    import lightning.pytorch as L

    from callbacks import StepsProgressBar

    for max_epochs, expected in ((-1, "Epoch 0"), (3, "Epoch 0/2")):
        bar = StepsProgressBar()
        bar.setup(L.Trainer(max_steps=5, max_epochs=max_epochs, callbacks=[bar], logger=False), None, "fit")
        assert bar._get_train_description(0).strip() == expected


def test_train_py_uses_the_steps_progress_bar():
    pytest.importorskip("rich")
    from callbacks import StepsProgressBar

    cli = main([*FAST, "--max_steps", "1", "--trainer.enable_progress_bar", "true", "--trainer.limit_val_batches", "0"])
    assert isinstance(cli.trainer.progress_bar_callback, StepsProgressBar)
