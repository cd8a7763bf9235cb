"""Resuming honours the command line: typed settings take effect (the optimizer's too) and the log names them;
untyped model settings continue the checkpoint's; a shape or tokenizer that differs is refused in one line."""

from __future__ import annotations

import os
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
import yaml
from environment import environment_kept

from lm_systems.lit_module import LitLM
from train import main

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI.s args parameter")  # pytest's own argv
QUIET = [
    "--trainer.limit_val_batches",
    "0",
    "--trainer.enable_model_summary",
    "false",
    "--trainer.enable_progress_bar",
    "false",
]


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, tiny_args) -> tuple[Path, list[str]]:
    """A run at lr 0.5, one warm-up step, no clipping and the skip policy; its step=2.ckpt and the flags to reuse."""
    root = tmp_path_factory.mktemp("first_run")
    common = [*tiny_args, *QUIET]
    with environment_kept():
        main(
            [
                *common,
                "--trainer.logger.init_args.save_dir",
                str(root),
                "--max_steps",
                "2",
                "--model.lr",
                "0.5",
                "--model.warmup_steps",
                "1",
                "--trainer.gradient_clip_val",
                "0",
                "--model.on_nonfinite",
                "skip",
            ]
        )
    (checkpoint,) = root.rglob("step=2.ckpt")
    return checkpoint, common


@pytest.mark.slow  # first_run trains
def test_typed_settings_take_effect_and_untyped_model_settings_continue(first_run, tmp_path, lightning_log):
    checkpoint, common = first_run
    resumed = main(
        [
            *common,
            *("--max_steps", "4", "--model.lr", "1e-3", "--trainer.gradient_clip_val", "1.0"),
            *("--ckpt_path", str(checkpoint)),
        ]
    )
    hparams = resumed.model.hparams
    assert hparams.lr == 1e-3 and hparams.warmup_steps == 1 and hparams.on_nonfinite == "skip"
    assert resumed.trainer.gradient_clip_val == 1.0 and resumed.trainer.global_step == 4
    # The restored optimizer and schedule train at the typed rate, at the schedule's step.
    optimizer = resumed.trainer.optimizers[0]
    scheduler = resumed.trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.base_lrs == [1e-3, 1e-3]
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        assert group["initial_lr"] == 1e-3
        assert group["lr"] == pytest.approx(1e-3 * factor(scheduler.last_epoch))
    assert yaml.safe_load((Path(resumed.trainer.logger.log_dir) / "config.yaml").read_text())["model"]["lr"] == 1e-3
    said = lightning_log.text
    assert "settings changed since it was saved:" in said
    for change in ("model.lr 0.5 → 0.001", "trainer.gradient_clip_val 0 → 1.0", "trainer.max_steps 2 → 4"):
        assert change in said, said


def usage_error(args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.slow  # first_run trains
def test_a_typed_shape_change_is_refused_naming_both_values(first_run, capsys):
    checkpoint, common = first_run
    line = usage_error([*common, "--model.d_model", "64", "--ckpt_path", str(checkpoint)], capsys)
    assert line.startswith("error: --model.d_model 64 does not match the checkpoint's 32"), line


@pytest.mark.slow  # first_run trains
def test_a_different_tokenizer_is_refused_naming_both(first_run, capsys):
    checkpoint, common = first_run
    line = usage_error(
        [*common, "--data.vocab_size", "275", "--max_steps", "3", "--ckpt_path", str(checkpoint)], capsys
    )
    assert "the data's tokenizer (275 tokens" in line and "is not the checkpoint's (300 tokens" in line, line


@pytest.fixture
def small_checkpoint(tmp_path) -> Path:
    """What resuming reads first: a `small` model's hyperparameters (no 114M weights needed to refuse or keep it)."""
    path = tmp_path / "small.ckpt"
    hparams = {**LitLM(size="small").hparams, "vocab_size": 1004}
    torch.save({"hyper_parameters": hparams, "state_dict": {}}, path)
    return path


def test_a_small_checkpoint_resumed_as_tiny_is_refused(small_checkpoint, capsys):
    line = usage_error(["--model.size", "tiny", "--max_steps", "1", "--ckpt_path", str(small_checkpoint)], capsys)
    assert line.startswith("error: --model.size 'tiny' does not match the checkpoint's 'small'"), line


def test_a_refused_context_length_names_the_checkpoints_resolved_one(small_checkpoint, capsys):
    line = usage_error(
        ["--model.context_length", "512", "--max_steps", "1", "--ckpt_path", str(small_checkpoint)], capsys
    )
    assert line.startswith("error: --model.context_length 512 does not match the checkpoint's 256"), line


def test_a_checkpoint_of_non_finite_weights_is_refused_naming_it(tmp_path, capsys):
    path = tmp_path / "diverged.ckpt"
    torch.save(
        {
            "hyper_parameters": {**LitLM().hparams, "vocab_size": 300},
            "state_dict": {"model.embedding.weight": torch.tensor([[1.0, float("nan")]])},
        },
        path,
    )
    line = usage_error(["--max_steps", "1", "--ckpt_path", str(path)], capsys)
    assert line.startswith(f"error: --ckpt_path {str(path)!r} holds non-finite weights (NaN or inf)"), line
    assert "--model.lr" not in line


def test_untyped_shape_settings_are_the_checkpoints(small_checkpoint, monkeypatch):
    def fit(self, model, train_dataloaders=None, val_dataloaders=None, datamodule=None, ckpt_path=None):
        """Build everything, train nothing (LightningCLI takes --ckpt_path from this signature)."""

    monkeypatch.setattr(L.Trainer, "fit", fit)
    cli = main(["--ckpt_path", str(small_checkpoint)])
    assert cli.model.hparams.size == "small" and cli.model.hparams.vocab_size == 1004
    assert cli.datamodule.context_length == 256  # the data windows follow the resumed model


# -- a resume continues the run it resumes ---------------------------------------------------------------------------

RUN_310 = {
    "trainer.strategy": "zero3",
    "trainer.devices": 2,
    "trainer.accelerator": "cpu",
    "trainer.max_steps": 310,
    "trainer.gradient_clip_val": 0.5,
    "data.synthetic": True,
    "data.vocab_size": 512,
    "data.batch_size": 3,
    "checkpointing_interval": 50,
}
"""What a two-process zero3 run of 310 steps on synthetic tokens stores of its settings (``RunConfigRecord``)."""


def run_checkpoint(path: Path, global_step: int, run_config: dict = RUN_310) -> Path:
    """A checkpoint of a tiny model whose run stored ``run_config``, saved at ``global_step`` (no weights needed)."""
    hparams = {**LitLM(size="tiny").hparams, "vocab_size": 512}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(
        {"global_step": global_step, "hyper_parameters": hparams, "state_dict": {}, "run_config": run_config}, path
    )
    return path


@pytest.fixture
def fit_not_run(monkeypatch) -> dict:
    """``Trainer.fit`` that records the ``ckpt_path`` it was handed and trains nothing."""
    handed: dict = {}

    def fit(self, model, train_dataloaders=None, val_dataloaders=None, datamodule=None, ckpt_path=None):
        """(LightningCLI takes --ckpt_path from this signature.)"""
        handed["ckpt_path"] = ckpt_path

    monkeypatch.setattr(L.Trainer, "fit", fit)
    return handed


def test_a_bare_resume_continues_the_runs_strategy_devices_steps_and_data(tmp_path, fit_not_run):
    cli = main(["--ckpt_path", str(run_checkpoint(tmp_path / "step=100.ckpt", 100))])
    trainer = cli.trainer
    assert type(trainer.strategy).__name__ == "Zero3Strategy" and trainer.num_devices == 2
    assert trainer.max_steps == 310 and trainer.gradient_clip_val == 0.5
    assert cli.datamodule.synthetic and cli.datamodule.vocab_size == 512 and cli.datamodule.batch_size == 3
    assert trainer.checkpoint_callback._every_n_train_steps == 50


def test_typed_settings_still_win_over_the_resumed_runs(tmp_path, fit_not_run):
    cli = main(
        [
            "--ckpt_path",
            str(run_checkpoint(tmp_path / "step=100.ckpt", 100)),
            "--strategy",
            "bucketed_ddp",
            "--max_steps",
            "400",
            "--data.batch_size",
            "4",
        ]
    )
    assert type(cli.trainer.strategy).__name__ == "BucketedDDPStrategy" and cli.trainer.num_devices == 2
    assert cli.trainer.max_steps == 400 and cli.datamodule.batch_size == 4


def test_a_resume_with_nothing_left_to_train_says_so_and_leaves_no_folder(tmp_path, capsys):
    path = run_checkpoint(tmp_path / "step=310.ckpt", 310)
    line = usage_error(["--ckpt_path", str(path)], capsys)
    assert line.startswith(f"error: --ckpt_path {str(path)!r} is at step 310, where --max_steps 310 ends the run"), line
    assert "--max_steps" in line.split("ends the run", 1)[1], line
    assert not (tmp_path / "logs").exists()


def test_validate_reads_a_finished_runs_checkpoint(tmp_path, monkeypatch):
    """Only fit is refused a checkpoint with nothing left to train: validate scores it."""
    handed: dict = {}

    def validate(self, model=None, dataloaders=None, ckpt_path=None, verbose=True, datamodule=None, weights_only=None):
        """(LightningCLI takes --ckpt_path from this signature.)"""
        handed["ckpt_path"] = ckpt_path

    monkeypatch.setattr(L.Trainer, "validate", validate)
    path = run_checkpoint(tmp_path / "step=310.ckpt", 310)
    main(["validate", "--ckpt_path", str(path)])
    assert handed["ckpt_path"] == str(path)


def test_ckpt_path_last_takes_the_crash_ckpt_a_stopped_run_just_named(tmp_path, fit_not_run):
    older = run_checkpoint(tmp_path / "logs" / "lm_systems" / "version_0" / "checkpoints" / "step=310.ckpt", 310)
    (older.parent / "last.ckpt").symlink_to(older.name)
    crash = run_checkpoint(tmp_path / "logs" / "lm_systems" / "version_1" / "checkpoints" / "crash.ckpt", 7)
    os.utime(older, (1_000_000, 1_000_000))  # written long before the crash
    main(["--ckpt_path", "last"])
    assert Path(fit_not_run["ckpt_path"]).resolve() == crash.resolve()


def test_ckpt_path_last_passes_over_an_older_crash_ckpt(tmp_path, fit_not_run):
    crash = run_checkpoint(tmp_path / "logs" / "lm_systems" / "version_0" / "checkpoints" / "crash.ckpt", 7)
    newer = run_checkpoint(tmp_path / "logs" / "lm_systems" / "version_1" / "checkpoints" / "step=100.ckpt", 100)
    (newer.parent / "last.ckpt").symlink_to(newer.name)
    os.utime(crash, (1_000_000, 1_000_000))
    main(["--ckpt_path", "last"])
    assert Path(fit_not_run["ckpt_path"]).resolve() == newer.resolve()


def test_help_says_what_ckpt_path_last_resumes(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "last: the newest checkpoint among the runs" in help_text, help_text
    assert "crash.ckpt" in help_text and "continues that run's settings" in help_text


@pytest.mark.slow  # first_run trains
def test_a_resume_typed_as_a_new_user_would_continues_the_run(first_run, lightning_log):
    checkpoint, _ = first_run
    resumed = main(["--ckpt_path", str(checkpoint), "--max_steps", "3"])  # none of the run's flags
    assert resumed.trainer.global_step == 3
    assert resumed.trainer.gradient_clip_val == 0 and resumed.trainer.limit_val_batches == 0
    assert resumed.datamodule.batch_size == 2 and resumed.datamodule.vocab_size == 300
    assert resumed.model.hparams.lr == 0.5
    assert "trainer.max_steps 2 → 3" in lightning_log.text


def test_a_strategy_class_continues_and_a_setting_this_version_lacks_is_dropped(tmp_path, fit_not_run):
    """A strategy typed with arguments is stored as its class and those (``strategy_flags``); a setting an older
    version stored and this one lacks is left out, not an error."""
    older = {key: value for key, value in RUN_310.items() if key != "trainer.strategy"}
    older["trainer.strategy.class_path"] = "strategies.Zero3Strategy"
    older["trainer.strategy.init_args.prefetch"] = 2
    older["data.removed_flag"] = 3
    cli = main(["--ckpt_path", str(run_checkpoint(tmp_path / "step=100.ckpt", 100, older))])
    assert type(cli.trainer.strategy).__name__ == "Zero3Strategy" and cli.trainer.num_devices == 2
    assert cli.config.fit.trainer.strategy.init_args.prefetch == 2 and cli.datamodule.batch_size == 3
