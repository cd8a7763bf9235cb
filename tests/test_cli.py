"""train.py's command line: help, short flags, a short run with TensorBoard, checkpoints and an exact resume, every
shipped config, the configured callbacks and progress bar, and errors that name the flag (two processes:
tests/test_train_py_two_processes.py)."""

from dataclasses import fields
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from every_model_option import EVERY_MODEL_OPTION
from lightning.pytorch.cli import LightningCLI
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from callbacks import StepsProgressBar
from callbacks.progress import StepsTQDMProgressBar
from lm_systems.data.datamodule import LMDataModule
from lm_systems.lit_module import LitLM
from lm_systems.model.config import MODEL_SIZES, ModelConfig
from train import main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def fast(tiny_args) -> list[str]:
    """A tiny run that logs every step and ends with a short sample; no progress bar."""
    return [
        *tiny_args,
        "--model.sample_prompt",
        "Once upon a time",
        "--model.sample_tokens",
        "8",
        "--trainer.log_every_n_steps",
        "1",
        "--trainer.enable_progress_bar",
        "false",
    ]


def test_help_lists_the_short_flags(tmp_path, train_py):
    env = train_py.environment(XDG_CACHE_HOME=str(tmp_path))  # the help cache (lm_systems.run.help_cache) stays in tmp
    out = train_py.run_ok("--help", cwd=REPO, env=env).stdout
    for flag in (
        "--strategy",
        "--precision",
        "--devices",
        "--max_steps",
        "--checkpointing_interval",
        "--model.size",
        "--data.corpus",
        "--ckpt_path",
    ):
        assert flag in out


@pytest.mark.slow
def test_short_run_logs_to_tensorboard_checkpoints_and_resumes(tmp_path, capsys, assert_same_training_state, fast):
    cli = main(
        [
            *fast,
            "--max_steps",
            "6",
            "--trainer.val_check_interval",
            "3",
            "--checkpointing_interval",
            "4",
            "--precision",
            "bf16-mixed",
        ]
    )
    assert cli.trainer.global_step == 6 and cli.trainer.precision == "bf16-mixed"
    log_dir = Path(cli.trainer.logger.log_dir)
    events = EventAccumulator(str(log_dir)).Reload()
    for tag in ("val/loss", "val/perplexity", "train/loss", "train/lr", "train/grad_norm", "train/tokens_per_sec"):
        assert tag in events.Tags()["scalars"], tag
    assert [e.step for e in events.Scalars("val/loss")] == [2, 5]
    ckpts = sorted(p.name for p in (log_dir / "checkpoints").iterdir())
    assert ckpts == ["last.ckpt", "step=4.ckpt", "step=6.ckpt"]
    assert "Sample after 6 steps" in capsys.readouterr().out

    # Resumed from step 4 (validation at step 5 again): step 6 as the uninterrupted run left it, bit for bit.
    resumed = main(
        [
            *fast,
            "--max_steps",
            "6",
            "--trainer.val_check_interval",
            "3",
            "--precision",
            "bf16-mixed",
            "--ckpt_path",
            str(log_dir / "checkpoints" / "step=4.ckpt"),
        ]
    )
    resumed_dir = Path(resumed.trainer.logger.log_dir)
    assert resumed_dir != log_dir and resumed.trainer.global_step == 6
    load = lambda path: torch.load(path, weights_only=False)  # noqa: E731
    assert_same_training_state(
        load(resumed_dir / "checkpoints" / "step=6.ckpt"), load(log_dir / "checkpoints" / "step=6.ckpt")
    )


@pytest.mark.slow  # a validation loop
def test_a_subcommand_other_than_fit_runs(fast):
    """Only the named subcommand's parser is built: ``validate`` must still parse and run its own loop."""
    cli = main(["validate", *fast, "--trainer.logger", "false"])
    assert cli.subcommand == "validate" and cli.trainer.state.fn == "validate"
    assert torch.isfinite(cli.trainer.callback_metrics["val/loss"])


@pytest.mark.parametrize("subcommand", ["test", "predict"])
def test_test_and_predict_are_refused_in_one_line_that_names_validate(subcommand, capsys):
    """Lightning's test and predict would end in a traceback here (no test split, no predict_step)."""
    with pytest.raises(SystemExit) as exit_:
        main([subcommand, "--max_steps", "1"])
    assert exit_.value.code == 2
    (said,) = capsys.readouterr().err.strip().splitlines()
    assert said.startswith(f"error: train.py has no {subcommand!r}") and "python train.py validate" in said


def test_no_logger_leaves_no_files_behind(tmp_path, tiny_args):
    """Lightning wrote LightningCLI's config.yaml into the working directory when there was no log folder."""
    cli = main(
        [
            *tiny_args,
            "--max_steps",
            "2",
            "--trainer.logger",
            "false",
            "--data.val_batches",
            "2",
            "--trainer.enable_progress_bar",
            "false",
        ]
    )
    assert cli.trainer.global_step == 2
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoints"]  # the data cache is the session's
    assert cli.trainer.num_val_batches == [2]  # the validation bar's total: it read "0/?"


def test_config_file_and_print_config(capsys):
    with pytest.raises(SystemExit):
        main(["-c", str(REPO / "configs" / "small.yaml"), "--print_config"])
    out = capsys.readouterr().out
    assert "size: small" in out and "max_steps: 5000" in out and "precision: bf16-mixed" in out


@pytest.mark.parametrize(
    "config", sorted(str(p.relative_to(REPO / "configs")) for p in (REPO / "configs").rglob("*.yaml"))
)
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
def test_bad_input_names_the_flag(args, message, capsys, fast):
    with pytest.raises((ValueError, FileNotFoundError, SystemExit)) as error:
        main([*fast, "--max_steps", "1", *args])
    if error.type is SystemExit:  # jsonargparse printed the usage (which lists every flag), then the error
        assert error.value.code == 2
        (said,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    else:
        said = str(error.value)
    assert message in said


def test_empty_corpus_names_the_flag(tmp_path, capsys, fast):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(SystemExit):  # a usage error, as for a value of the wrong type
        main([*fast, "--max_steps", "1", "--data.corpus", str(tmp_path / "empty.txt")])
    assert "--data.corpus" in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.parametrize("rich, bar", [(True, StepsProgressBar), (False, StepsTQDMProgressBar)])
def test_train_py_uses_the_steps_progress_bar(rich, bar, fast, monkeypatch, capsys):
    """Lightning's rich bar where rich is installed (the test extra installs it), else its tqdm bar; either way the
    subclass that counts optimizer steps, drawn through a whole run."""
    monkeypatch.setattr("callbacks.progress._rich_installed", lambda: rich)
    cli = main([*fast, "--max_steps", "2", "--trainer.enable_progress_bar", "true", "--trainer.limit_val_batches", "0"])
    assert type(cli.trainer.progress_bar_callback) is bar
    assert cli.trainer.progress_bar_callback.total_train_batches == 2


PROFILING_CALLBACKS = {"StepTimer", "MFUMonitor", "MemorySnapshot", "NVTXRanges"}
PROFILING_ARGS = [
    "-c",
    str(REPO / "configs/profiling.yaml"),
    "--trainer.accelerator",
    "cpu",
    "--trainer.logger",
    "false",
]


def test_profiling_config_builds_every_callback_and_the_profiler():
    cli = LightningCLI(LitLM, LMDataModule, run=False, save_config_callback=None, args=PROFILING_ARGS)
    assert PROFILING_CALLBACKS <= {type(c).__name__ for c in cli.trainer.callbacks}
    assert type(cli.trainer.profiler).__name__ == "PyTorchProfiler"
    assert cli.trainer.profiler._profiler_kwargs["profile_memory"] is True


def test_train_py_keeps_the_configured_callbacks(monkeypatch):
    monkeypatch.setattr(L.Trainer, "fit", lambda *args, **kwargs: None)  # build everything, train nothing
    cli = main(["fit", *PROFILING_ARGS])
    assert PROFILING_CALLBACKS | {"StepCheckpoint", "CrashCheckpoint", "GCFreeze"} <= {
        type(c).__name__ for c in cli.trainer.callbacks
    }


def test_the_cli_lists_the_strategy_names_handed_in_first():
    from lm_systems.run.door_checks import check_trainer_choices

    with pytest.raises(ValueError) as error:
        check_trainer_choices({"strategy": "nope", "devices": 1}, ours=("ddp_spawn",))
    assert "one of: auto, ddp_spawn, " in str(error.value)


def test_every_model_config_field_is_a_model_flag_that_reaches_the_model(tiny_args, capsys):
    """``--model.<field>`` for each ModelConfig field, by its name, its help the field's docstring; the built model's
    config holds exactly the values typed."""
    assert set(EVERY_MODEL_OPTION) == {f.name for f in fields(ModelConfig)}, "give the new field a value here"
    small, typed = MODEL_SIZES["small"], dict(EVERY_MODEL_OPTION, size="tiny")  # small's fields against the others
    assert all(value != getattr(small, name) for name, value in typed.items())
    flags = [part for name, value in EVERY_MODEL_OPTION.items() for part in (f"--model.{name}", str(value))]
    cli = main([*tiny_args, *flags], run=False)
    cli.model.configure_model()
    built = cli.model.model.config
    assert {name: getattr(built, name) for name in EVERY_MODEL_OPTION} == EVERY_MODEL_OPTION
    assert cli.datamodule.context_length == EVERY_MODEL_OPTION["context_length"]
    help_text = " ".join(cli.parser.format_help().split())
    for field in fields(ModelConfig):
        assert f"--model.{field.name} " in help_text
    assert "What backward recomputes, not kept" in help_text  # a field's docstring is its flag's help
