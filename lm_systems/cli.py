"""The training command line: LightningCLI over LitLM and LMDataModule, with `fit` as the default subcommand."""

from __future__ import annotations

import sys
from typing import Optional, Union

from lightning.pytorch.callbacks import LearningRateMonitor, RichProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import strategies  # noqa: F401  registers naive_ddp, overlap_ddp, bucketed_ddp, zero1 (and *_spawn) by name
from callbacks.progress import StepsProgressBar
from callbacks.throughput import MFUMonitor

from lm_systems.checkpointing import IntervalCheckpoint
from lm_systems.config import ModelConfig
from lm_systems.data.datamodule import LMDataModule
from lm_systems.generate import require_checkpoint_file
from lm_systems.lit_module import LitLM

SUBCOMMANDS = ("fit", "validate", "test", "predict")

SHORT_FLAGS: dict[str, tuple[type, str]] = {
    "strategy": (Optional[str], "ddp, naive_ddp, overlap_ddp, bucketed_ddp, zero1, zero3 (each also *_spawn), auto, …"),
    "precision": (Optional[str], "32-true, bf16-mixed, 16-mixed, bf16-true, …"),
    "accelerator": (Optional[str], "cpu, gpu, auto"),
    "devices": (Optional[Union[int, str]], "processes per node: a count, 'auto', or a list such as '0,1'"),
    "num_nodes": (Optional[int], "number of machines"),
    "max_steps": (Optional[int], "optimizer steps to train for"),
    "accumulate_grad_batches": (Optional[int], "micro-batches per optimizer step"),
}
"""``--strategy X`` is short for ``--trainer.strategy X``; the short form wins when both are given."""

TRAINER_DEFAULTS = {
    "max_steps": 300,
    "val_check_interval": 50,
    "check_val_every_n_epoch": None,  # the training stream is endless: validate by steps
    "log_every_n_steps": 10,
    "gradient_clip_val": 1.0,
    "devices": 1,
    "enable_checkpointing": False,  # IntervalCheckpoint does it, per --checkpointing_interval
    "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"save_dir": "logs", "name": "lm_systems", "default_hp_metric": False}},
}


def _data_context_length(size: str, context_length: Optional[int]) -> int:
    return ModelConfig.from_name(size, context_length=context_length).context_length


class LMCLI(LightningCLI):
    """LightningCLI with short trainer flags, a checkpointing interval and checked checkpoint paths."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        group = parser.add_argument_group("Short forms of common --trainer.* flags")
        for name, (kind, help_text) in SHORT_FLAGS.items():
            group.add_argument(f"--{name}", type=kind, default=None, help=f"{help_text} (--trainer.{name})")
        parser.add_argument(
            "--checkpointing_interval", type=int, default=0,
            help="> 0: save a checkpoint every N optimizer steps; <= 0: only at the end. The final step is always saved.",
        )
        parser.set_defaults({"data.val_batches": 16})  # keeps the embedded default run near two minutes
        # The data windows are as long as the model's context.
        parser.link_arguments(("model.size", "model.context_length"), "data.context_length", compute_fn=_data_context_length)

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        for name in SHORT_FLAGS:
            if config.get(name) is not None:
                config.trainer[name] = config[name]
        ckpt_path = config.get("ckpt_path")
        if ckpt_path not in (None, "last", "best", "hpc", "registry"):
            require_checkpoint_file(ckpt_path, "--ckpt_path")

    def instantiate_trainer(self, **kwargs):
        trainer = super().instantiate_trainer(**kwargs)  # with the callbacks from YAML and --trainer.callbacks
        trainer.callbacks.append(IntervalCheckpoint(self._get(self.config, "checkpointing_interval", default=0)))
        defaults = [MFUMonitor()] + ([LearningRateMonitor(logging_interval="step")] if trainer.loggers else [])
        for default in defaults:  # unless configured already
            if not any(isinstance(callback, type(default)) for callback in trainer.callbacks):
                trainer.callbacks.append(default)
        bar = trainer.progress_bar_callback
        if type(bar) is RichProgressBar:  # Lightning's default when rich is installed
            trainer.callbacks[trainer.callbacks.index(bar)] = StepsProgressBar()
        return trainer


def main(args: Optional[list[str]] = None, run: bool = True) -> LMCLI:
    """Entry point of ``train.py``; with no subcommand given, ``fit`` is run.

    ``run=False`` parses ``args`` (no subcommand) and builds the model, data and trainer without running.
    """
    given = sys.argv[1:] if args is None else args
    if run and (not given or given[0] not in SUBCOMMANDS):
        if args is None:
            sys.argv.insert(1, "fit")  # LightningCLI reads sys.argv itself when given no args
        else:
            args = ["fit", *args]
    return LMCLI(
        LitLM,
        LMDataModule,
        trainer_defaults=TRAINER_DEFAULTS,
        seed_everything_default=1234,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )
