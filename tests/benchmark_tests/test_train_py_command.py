"""benchmarks.train_py_command: the one builder of train.py command lines. Both runners build theirs through it, and
what it builds parses into the recipe it states, a runner's own flags winning."""

import sys
import warnings

import torch

from benchmarks import scaling
from benchmarks import train as train_bench
from benchmarks import train_py_command as builder
from benchmarks.train_py_command import REPO, TrainPyRun, train_py_args, train_py_command

# A recipe unlike LitLM's defaults: each value reaches train.py only if the builder states it.
RECIPE = {"LR": 2e-4, "WARMUP_STEPS": 3, "MIN_LR_RATIO": 0.2, "WEIGHT_DECAY": 0.05, "BETAS": (0.8, 0.9), "CLIP": 0.5}


def test_both_runners_build_their_command_lines_through_it(tmp_path):
    args = scaling.parse_args(["--accelerator", "cpu", "--size", "tiny", "--configs", "32x4:eager"])
    command = scaling.visit_command(args.configs[0], args.setups[0], args, tmp_path, tmp_path / "timer")
    steps = args.warmup + args.steps * args.segments + args.trace_steps
    run = TrainPyRun("cpu", "tiny", 32, 4, args.precision, args.attention, False, steps, tmp_path / "logs")
    built = train_py_command(run)
    assert command[: len(built)] == built and built[:2] == [sys.executable, str(REPO / "train.py")]

    setup = train_bench.Setup("tiny", 32, 2, "bf16-mixed", "sdpa", compile=True)
    run = TrainPyRun("cpu", "tiny", 32, 2, "bf16-mixed", "sdpa", True, 5, tmp_path)
    assert train_bench.train_py_args(setup, 5, tmp_path, torch.device("cpu")) == train_py_args(run)


def test_the_flags_parse_into_the_recipe_and_a_runners_own_flags_win(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name, value in RECIPE.items():
        monkeypatch.setattr(builder, name, value)
    from train import main

    run = TrainPyRun("cpu", "tiny", 32, 2, "32-true", "sdpa", False, 7, tmp_path / "logs")
    tiny_data = ["--data.generated_stories", "300", "--data.vocab_size", "300"]
    with warnings.catch_warnings():  # that pytest's own sys.argv exists beside these args is intended here
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        cli = main(train_py_args(run, *tiny_data, "--max_steps", "9"), run=False)
    hparams = cli.model.hparams
    assert (hparams.lr, hparams.warmup_steps, hparams.min_lr_ratio) == (2e-4, 3, 0.2)
    assert hparams.weight_decay == 0.05 and tuple(hparams.betas) == (0.8, 0.9)
    assert hparams.attention == "sdpa" and not hparams.compile and hparams.sample_prompt == ""
    assert cli.datamodule.batch_size == 2 and cli.datamodule.context_length == 32
    trainer = cli.trainer
    assert trainer.gradient_clip_val == 0.5 and trainer.limit_val_batches == 0 and trainer.checkpoint_callback is None
    assert trainer.max_steps == 9, "the runner's own --max_steps, given last, wins"
    assert trainer.logger.save_dir == str(tmp_path / "logs")
