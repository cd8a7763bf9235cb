"""The training command line: LightningCLI over LitLM and LMDataModule, with `fit` as the default subcommand."""

from __future__ import annotations

import inspect
import logging
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

from jsonargparse import set_parsing_settings
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lm_systems.compat.lightning import CommandLineOverCheckpointCLI
from lm_systems.data.datamodule import LMDataModule
from lm_systems.errors import InputError, one_line, reported_errors, request_debug
from lm_systems.files.checkpoint_io import NEWEST, SafeCheckpointIO, require_checkpoint_file
from lm_systems.lit_module import LitLM
from lm_systems.model.config import MODEL_SIZES, ModelConfig
from lm_systems.run.cpu_threads import choose_cpu_threads
from lm_systems.run.door_checks import (
    check_config_files,
    check_data_settings,
    check_model_fits_device,
    check_trainer_choices,
    device_type,
    make_output_folder,
)
from lm_systems.run.help_cache import NOT_OFFERED, SUBCOMMANDS
from lm_systems.run.logger import run_version_of
from lm_systems.run.resume import SavedSettings, resolved_ckpt_path
from lm_systems.run.strategy_flags import strategy_names_as_classes
from lm_systems.run_callbacks.checkpoints import CrashCheckpoint, StepCheckpoint
from lm_systems.run_callbacks.config_file import RunConfigFile
from lm_systems.run_callbacks.rank_watch import RankWatch
from lm_systems.run_callbacks.resume_settings import ResumedLoggingSteps, RunConfigRecord
from lm_systems.run_callbacks.summary import RunSummary

SHORT_FLAGS: dict[str, tuple[type, str]] = {
    "strategy": (Optional[str], "ddp, naive_ddp, overlap_ddp, bucketed_ddp, zero1, zero3 (each also *_spawn), auto, …"),
    "precision": (inspect.signature(Trainer).parameters["precision"].annotation, "32-true, bf16-mixed, bf16-true, …"),
    "accelerator": (Optional[str], "cpu, gpu, auto"),
    "devices": (Optional[Union[int, str]], "processes per node: a count, 'auto', or a list such as '0,1'"),
    "num_nodes": (Optional[int], "number of machines"),
    "max_steps": (Optional[int], "optimizer steps to train for"),
    "accumulate_grad_batches": (Optional[int], "micro-batches per optimizer step"),
}
"""``--strategy X`` is short for ``--trainer.strategy X``; the short form wins when both are given. A typed one is
jsonargparse's to check (precision: the Trainer's own Literal type); names are checked at the door."""

TRAINER_DEFAULTS = {
    "max_steps": 300,
    "val_check_interval": 20,  # 15 validation points: fewer read as a line under TensorBoard's smoothing
    "check_val_every_n_epoch": None,  # the training stream is endless: validate by steps
    "log_every_n_steps": 10,
    "gradient_clip_val": 1.0,
    "devices": 1,
    "enable_model_summary": False,  # its FLOPs column reads 0 and it warns under bf16; LitLM's line has the size
    "logger": {
        "class_path": "lm_systems.run.logger.RunLogger",
        "init_args": {"save_dir": "logs", "name": "lm_systems", "default_hp_metric": False},
    },
}


CKPT_PATH_HELP = (
    f"the checkpoint to resume from: a path, or {NEWEST}: the newest checkpoint among the runs under "
    "--trainer.default_root_dir (else the working folder): their last.ckpt, or the crash.ckpt a stopped run named. "
    "The resumed run continues that run's settings (strategy, devices, max_steps, data, model); those typed "
    "here win, except the model's shape. A checkpoint already at --max_steps is refused: raise it to train on."
)


@dataclass(frozen=True)
class RunOptions:
    """The run's own flags, beside the model's, the data's and the trainer's."""

    checkpointing_interval: int = 0
    """> 0: a step=N.ckpt every N optimizer steps; <= 0: only at the end (the final step is always saved; last.ckpt
    links the newest). A ModelCheckpoint of your own in trainer.callbacks replaces this."""
    checkpointing_keep: int = 0
    """> 0: keep only this run's newest K step checkpoints, an older one removed once a newer one is whole (the disk
    holds K + 1 while one is written); 0: keep them all"""
    resume_into_run: bool = False
    """with --ckpt_path .../version_N/checkpoints/X.ckpt: keep logging into version_N, not a new version"""
    cpu_step_limit_s: float = 600
    """on a CPU, refuse a model whose step is estimated to take longer than this many seconds (from its parameters and
    tokens a step); 0: no limit"""
    debug: bool = False
    """on an error, show the whole traceback instead of one line (also LM_SYSTEMS_DEBUG=1)"""


def _data_context_length(size: str, context_length: Optional[int]) -> int:
    """The model's context, which the data windows follow. A bad size or length is LitLM's to report (naming the
    flag); jsonargparse would wrap an error raised here in a dump of this link."""
    if context_length is not None:
        return context_length
    return MODEL_SIZES[size if size in MODEL_SIZES else ModelConfig.size].context_length


class LMArgumentParser(LightningArgumentParser):
    """LightningArgumentParser whose errors end in one line, after a one-line usage (``--help`` has the rest)."""

    def print_usage(self, file: Any = None) -> None:
        (file or sys.stderr).write(f"usage: {self.prog} [-c CONFIG] [--key VALUE ...]\n")

    def parse_args(self, args: Any = None, *more: Any, **kwargs: Any) -> Any:
        args = strategy_names_as_classes(sys.argv[1:] if args is None else args)
        try:
            check_config_files(args)
        except InputError as error:
            self.error(str(error))
        return super().parse_args(args, *more, **kwargs)

    def error(self, message: str, ex: Optional[Exception] = None) -> Any:
        super().error(one_line(message), ex)

    def add_method_arguments(self, *args: Any, **kwargs: Any) -> Any:
        added = super().add_method_arguments(*args, **kwargs)
        for action in self._actions:
            if action.dest == "ckpt_path":  # Lightning's text describes its own `last`, not this project's
                action.help = CKPT_PATH_HELP
        return added


class LMCLI(CommandLineOverCheckpointCLI):
    """LightningCLI with short trainer flags, step checkpoints, run folders and checks at the door; a ``--ckpt_path``'s
    saved settings go *under* the command line (:mod:`lm_systems.run.resume`). The entry point hands in the
    ``strategy_names`` it registered, makers of the ``callbacks`` every run gets (unless the configuration brings one
    of the type) and of the ``progress_bar`` for a refresh rate in batches (None: Lightning's). ``subcommand``: the
    one the command line names; only its parser is built (each of Lightning's four took about a second to build)."""

    def __init__(
        self,
        *args: Any,
        subcommand: Optional[str] = None,
        strategy_names: Sequence[str] = (),
        callbacks: Callable[[], list[Callback]] = list,
        progress_bar: Optional[Callable[[int], ProgressBar]] = None,
        **kwargs: Any,
    ) -> None:
        self._subcommand = subcommand
        self._strategy_names, self._callbacks, self._progress_bar = strategy_names, callbacks, progress_bar
        super().__init__(*args, **kwargs)  # parses and runs

    def subcommands(self) -> dict[str, set[str]]:
        every = super().subcommands()
        return {self._subcommand: every[self._subcommand]} if self._subcommand in every else every

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        group = parser.add_argument_group("Short forms of common --trainer.* flags")
        for name, (kind, help_text) in SHORT_FLAGS.items():
            group.add_argument(f"--{name}", type=kind, default=None, help=f"{help_text} (--trainer.{name})")
        parser.add_class_arguments(RunOptions, nested_key=None, instantiate=False)
        # The data windows are as long as the model's context.
        parser.link_arguments(
            ("model.size", "model.context_length"), "data.context_length", compute_fn=_data_context_length
        )

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        super().parse_arguments(parser, args)
        if _subcommand_part(self.config).get("debug"):
            request_debug()
        try:  # checked here, before Lightning reads the checkpoint or builds anything
            config = _subcommand_part(self.config)
            ckpt_path = resolved_ckpt_path(config.get("ckpt_path"), config.trainer.get("default_root_dir"))
            saved = None
            if ckpt_path not in (None, "best", "hpc", "registry"):  # Lightning's own names
                require_checkpoint_file(ckpt_path, "--ckpt_path")
                saved = SavedSettings(ckpt_path)
                self.config = saved.under(parser, args, self.config)
                config = _subcommand_part(self.config)
                config["ckpt_path"] = ckpt_path  # resolved: parsing again over the saved settings reads `last`
            for name in SHORT_FLAGS:
                if config.get(name) is not None:
                    config.trainer[name] = config[name]
            if saved is not None and self._subcommand in (None, "fit"):  # validate only reads it
                saved.refuse_a_finished_run(config.trainer.get("max_steps"))
            accelerator = config.trainer.get("accelerator")
            check_trainer_choices(config.trainer, self._strategy_names, short_flags=SHORT_FLAGS)
            check_data_settings(config.data, config.model, accelerator)
            accumulate = config.trainer.get("accumulate_grad_batches")
            micro_batches = accumulate if isinstance(accumulate, int) and accumulate > 0 else 1
            tokens_per_step = config.data.batch_size * config.data.context_length * micro_batches  # one process's
            check_model_fits_device(config.model, accelerator, tokens_per_step, config.get("cpu_step_limit_s") or 0)
            choose_cpu_threads(device_type(accelerator))
            make_output_folder(config.trainer.get("default_root_dir"), "--trainer.default_root_dir")
            make_output_folder(config.data.get("cache_dir"), "--data.cache_dir")
            _logs_under_default_root_dir(config.trainer)
            if saved is not None:
                saved.log_changes(config)
            if config.get("resume_into_run"):
                _log_into_the_checkpoints_run(config)
        except (ValueError, OSError) as error:
            parser.error(str(error))

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, OSError, MisconfigurationException) as error:  # bad values in the configuration
            self.parser.error(str(error))

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        """Lightning's trainer with this project's checkpointing, progress bar, checkpoint writer and run callbacks,
        wherever the configuration does not bring its own."""
        config, trainer_config = _subcommand_part(self.config), _subcommand_part(self.config_init).get("trainer", {})
        trainer_config = {**trainer_config, **kwargs}
        callbacks, plugins = _as_list(trainer_config.get("callbacks")), _as_list(trainer_config.get("plugins"))
        if trainer_config.get("enable_checkpointing") is not False:
            interval, keep = config.get("checkpointing_interval", 0), config.get("checkpointing_keep", 0)
            if keep < 0:
                self.parser.error(f"--checkpointing_keep must be 0 (keep every checkpoint) or more, got {keep}")
            if not _has(callbacks, ModelCheckpoint):
                callbacks.append(StepCheckpoint(interval, keep=keep))
            else:
                for flag, value, there in (
                    ("--checkpointing_interval", interval, "every_n_train_steps"),
                    ("--checkpointing_keep", keep, "save_top_k"),
                ):
                    if value > 0:
                        self.parser.error(
                            f"{flag} is set and trainer.callbacks has its own ModelCheckpoint: "
                            f"set {there} there, or drop one of the two"
                        )
            callbacks.append(CrashCheckpoint())
        bar = self._progress_bar
        if bar and trainer_config.get("enable_progress_bar") is not False and not _has(callbacks, ProgressBar):
            # Redrawn on logged steps only: a rich redraw per step cost the lent GPU hosts more time than Lightning's
            # whole step (benchmarks/results/train_step.md).
            callbacks.append(bar(trainer_config.get("log_every_n_steps") or 1))
        if not _has(plugins, CheckpointIO):
            plugins.append(SafeCheckpointIO())
        # After the progress bar: the summary prints once the bar has stopped.
        defaults = [
            *self._callbacks(),
            RunConfigRecord(config),
            ResumedLoggingSteps(),
            RankWatch(),
            RunSummary(offers_sampling=not config.data.get("synthetic")),
        ]
        callbacks += [callback for callback in defaults if not _has(callbacks, type(callback))]
        return super().instantiate_trainer(**{**kwargs, "callbacks": callbacks, "plugins": plugins})


def _log_into_the_checkpoints_run(config: Any) -> None:
    """``--resume_into_run``: the default logger writes into the run folder ``--ckpt_path`` lies in."""
    ckpt_path = config.get("ckpt_path")
    run = run_version_of(ckpt_path) if ckpt_path else None
    if run is None:
        raise InputError(
            f"--resume_into_run needs a --ckpt_path inside <save_dir>/<name>/version_N/checkpoints/, got {ckpt_path!r}"
        )
    logger = config.trainer.get("logger")
    if not (getattr(logger, "class_path", "") or "").endswith(("RunLogger", "TensorBoardLogger")):
        raise InputError("--resume_into_run continues a TensorBoard run folder: leave --trainer.logger at its default")
    logger.init_args.save_dir, logger.init_args.name, logger.init_args.version = run
    warnings.filterwarnings("ignore", message="Checkpoint directory .* exists and is not empty")  # it is asked for


def _logs_under_default_root_dir(trainer: Any) -> None:
    """``--trainer.default_root_dir D`` puts the default logger's runs in ``D/logs/lm_systems/version_N`` (as the
    default puts them in ``./logs/...``); a save_dir of the logger's own is kept."""
    logger, root, default = trainer.get("logger"), trainer.get("default_root_dir"), TRAINER_DEFAULTS["logger"]
    if root is None or getattr(logger, "class_path", None) != default["class_path"]:
        return
    if logger.init_args.save_dir == default["init_args"]["save_dir"]:
        logger.init_args.save_dir = os.path.join(root, default["init_args"]["save_dir"])


def _subcommand_part(config: Any) -> Any:
    """The part of a parsed (or instantiated) configuration that belongs to its subcommand (``fit``), or all of it."""
    subcommand = config.get("subcommand")
    return config[subcommand] if subcommand else config


def _as_list(items: Any) -> list[Any]:
    return list(items) if isinstance(items, list) else [] if items is None else [items]


def _has(items: list[Any], kind: type) -> bool:
    return any(isinstance(item, kind) for item in items)


def _quiet_lightning() -> None:
    """Drop Lightning's lines that tell nothing ours do not: its tip (advertising), where it trains (the model's line
    says), and ``Trainer.fit stopped`` (printed onto the bar; the summary counts the steps); and its warnings about
    the validation windows' length (shared out among workers) and a deprecation against newer torch."""
    untelling = ("💡 Tip", "GPU available:", "TPU available:", "HPU available:", "`Trainer.fit` stopped:")
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(
        lambda record: not str(record.msg).startswith(untelling)
    )
    warnings.filterwarnings("ignore", message=r"Your `IterableDataset` has `__len__` defined")
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")


def main(args: Optional[list[str]] = None, run: bool = True, **entry_parts: Any) -> LMCLI:
    """Entry point of ``train.py``, which hands in ``entry_parts`` (see ``LMCLI``); with no subcommand, ``fit`` runs.
    Errors end in one line with an exit status (:mod:`lm_systems.errors`). ``run=False`` parses ``args`` (no
    subcommand) and builds the model, data and trainer without running."""
    given = sys.argv[1:] if args is None else args
    if run and (not given or given[0] not in SUBCOMMANDS):
        if args is None:
            sys.argv.insert(1, "fit")  # LightningCLI reads sys.argv itself when given no args
        else:
            args = ["fit", *args]
    subcommand = (sys.argv[1] if args is None else args[0]) if run else None
    _quiet_lightning()
    set_parsing_settings(docstring_parse_attribute_docstrings=True)  # ModelConfig's field docstrings: --model.* help
    with reported_errors():
        if run and given and given[0] in NOT_OFFERED:
            raise InputError(
                f"train.py has no {given[0]!r}: the data has a training and a validation split and the model no "
                "predict_step; to score a checkpoint on the validation split: python train.py validate --ckpt_path PATH"
            )
        return LMCLI(
            LitLM,
            LMDataModule,
            parser_class=LMArgumentParser,
            trainer_defaults=TRAINER_DEFAULTS,
            seed_everything_default=1234,
            save_config_callback=RunConfigFile,
            save_config_kwargs={"overwrite": True},
            args=args,
            run=run,
            subcommand=subcommand,
            **entry_parts,
        )
