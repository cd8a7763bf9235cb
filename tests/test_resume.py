"""Resuming honours the command line: typed settings take effect (the optimizer's too) and the log names them;
untyped model settings continue the checkpoint's; a shape or tokenizer that differs is refused in one line."""

from __future__ import annotations

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
    resumed = main([*common, "--max_steps", "4", "--model.lr", "1e-3", "--ckpt_path", str(checkpoint)])
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
    line = usage_error([*common, "--data.vocab_size", "275", "--ckpt_path", str(checkpoint)], capsys)
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
