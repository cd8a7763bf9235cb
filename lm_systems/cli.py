"""The training command line: LightningCLI over LitLM and LMDataModule, with `fit` as the default subcommand."""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from collections.abc import Sequence
from typing import Any, Optional, Union

from jsonargparse import set_parsing_settings
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lm_systems.compat.lightning import CommandLineOverCheckpointCLI, precision_names
from lm_systems.data.datamodule import LMDataModule
from lm_systems.errors import DEBUG_ENV, InputError, one_line, reported_errors, request_debug
from lm_systems.files.checkpoint_io import NEWEST, SafeCheckpointIO, require_checkpoint_file
from lm_systems.lit_module import LitLM
from lm_systems.model.config import MODEL_SIZES, ModelConfig
from lm_systems.run.cli_parts import CLIParts
from lm_systems.run.config_files import check_config_files
from lm_systems.run.cpu_threads import choose_cpu_threads
from lm_systems.run.data_checks import check_data_settings
from lm_systems.run.device_fit import check_model_fits_device, device_type
from lm_systems.run.help_cache import SUBCOMMANDS
from lm_systems.run.logger import run_version_of
from lm_systems.run.output_folders import make_output_folder
from lm_systems.run.resume import SavedSettings, checkpoint_to_resume
from lm_systems.run.strategy_flags import strategy_names_as_classes
from lm_systems.run_callbacks.checkpoints import CrashCheckpoint, StepCheckpoint
from lm_systems.run_callbacks.config_file import RunConfigFile
from lm_systems.run_callbacks.rank_watch import RankWatch
from lm_systems.run_callbacks.resume_settings import ResumedLoggingSteps, RunConfigRecord
from lm_systems.run_callbacks.summary import RunSummary

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
    """LightningCLI with short trainer flags, step checkpoints, run folders and checks at the door.

    A ``--ckpt_path``'s saved settings go *under* the command line (``parse_arguments``, :mod:`lm_systems.run.resume`):
    its base leaves out LightningCLI's parsing of them over it. ``parts``: what the entry point adds (our strategies'
    names, the default callbacks and progress bar)."""

    def __init__(self, *args: Any, parts: CLIParts, **kwargs: Any) -> None:
        self._parts = parts  # before LightningCLI's __init__, which parses and runs
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        group = parser.add_argument_group("Short forms of common --trainer.* flags")
        for name, (kind, help_text) in SHORT_FLAGS.items():
            group.add_argument(f"--{name}", type=kind, default=None, help=f"{help_text} (--trainer.{name})")
        parser.add_argument(
            "--checkpointing_interval",
            type=int,
            default=0,
            help="> 0: a step=N.ckpt every N optimizer steps; <= 0: only at the end (the final step is always "
            "saved; last.ckpt links the newest). A ModelCheckpoint of your own in trainer.callbacks replaces this.",
        )
        parser.add_argument(
            "--resume_into_run",
            type=bool,
            default=False,
            help="with --ckpt_path .../version_N/checkpoints/X.ckpt: keep logging into version_N, not a new version",
        )
        parser.add_argument(
            "--cpu_step_limit_s",
            type=float,
            default=600,
            help="on a CPU, refuse a model whose step is estimated to take longer than this many seconds (from its "
            "parameters and tokens a step); 0: no limit",
        )
        parser.add_argument(
            "--debug",
            type=bool,
            default=False,
            help=f"on an error, show the whole traceback instead of one line (also {DEBUG_ENV}=1)",
        )
        # The data windows are as long as the model's context.
        parser.link_arguments(
            ("model.size", "model.context_length"), "data.context_length", compute_fn=_data_context_length
        )

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        super().parse_arguments(parser, args)
        if _subcommand_part(self.config).get("debug"):
            request_debug()
        # Checked here, before Lightning reads the checkpoint or builds anything.
        try:
            ckpt_path, saved = _resolved_ckpt_path(_subcommand_part(self.config)), None
            if ckpt_path not in (None, "best", "hpc", "registry"):  # Lightning's own names
                require_checkpoint_file(ckpt_path, "--ckpt_path")
                saved = SavedSettings(ckpt_path)
                self.config = saved.under(parser, args, self.config)
            config = _subcommand_part(self.config)
            if ckpt_path is not None:  # resolved (parsing again over the checkpoint's settings reads `last`)
                config["ckpt_path"] = ckpt_path
            for name in SHORT_FLAGS:
                if config.get(name) is not None:
                    config.trainer[name] = config[name]
            if saved is not None:
                saved.refuse_a_finished_run(config.trainer.get("max_steps"))
            check_trainer_choices(config.trainer, self._parts.strategy_names)
            check_data_settings(config.data, config.model, config.trainer.get("accelerator"))
            check_model_fits_device(
                config.model,
                config.trainer.get("accelerator"),
                tokens_per_step=_tokens_per_step(config),
                cpu_step_limit_s=config.get("cpu_step_limit_s") or 0,
            )
            choose_cpu_threads(device_type(config.trainer.get("accelerator")))
            make_output_folder(config.trainer.get("default_root_dir"), "--trainer.default_root_dir")
            make_output_folder(config.data.get("cache_dir"), "--data.cache_dir")
            _logs_under_default_root_dir(config.trainer)
            if saved is not None:
                saved.log_changes(config)
            if config.get("resume_into_run"):
                self._log_into_the_checkpoints_run(config)
        except (ValueError, OSError) as error:
            parser.error(str(error))

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, OSError, MisconfigurationException) as error:  # bad values in the configuration
            self.parser.error(str(error))

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        """Lightning's trainer with this project's checkpointing, progress bar and checkpoint writer, wherever the
        configuration does not bring its own."""
        trainer_config = {**_subcommand_part(self.config_init).get("trainer", {}), **kwargs}
        callbacks = trainer_config.get("callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, list) else [callbacks]
        if trainer_config.get("enable_checkpointing") is not False:
            callbacks += self._checkpoint_callbacks(callbacks)
        make_bar = self._parts.progress_bar
        if make_bar and trainer_config.get("enable_progress_bar") is not False and not _has(callbacks, ProgressBar):
            # Redrawn on logged steps only: a rich redraw per step cost the lent GPU hosts more time than Lightning's
            # whole step (benchmarks/results/train_step.md).
            callbacks.append(make_bar(trainer_config.get("log_every_n_steps") or 1))
        plugins = trainer_config.get("plugins") or []
        plugins = list(plugins) if isinstance(plugins, list) else [plugins]
        if not _has(plugins, CheckpointIO):
            plugins.append(SafeCheckpointIO())
        # After the progress bar: the summary prints once the bar has stopped.
        defaults = [
            *self._parts.callbacks(),
            RunConfigRecord(_subcommand_part(self.config)),
            ResumedLoggingSteps(),
            RankWatch(),
            RunSummary(offers_sampling=not _subcommand_part(self.config).data.get("synthetic")),
        ]
        callbacks += [callback for callback in defaults if not _has(callbacks, type(callback))]
        return super().instantiate_trainer(**{**kwargs, "callbacks": callbacks, "plugins": plugins})

    def _checkpoint_callbacks(self, configured: list[Any]) -> list[Checkpoint]:
        interval = _subcommand_part(self.config).get("checkpointing_interval", 0)
        added: list[Checkpoint] = []
        if not _has(configured, ModelCheckpoint):
            added.append(StepCheckpoint(interval))
        elif interval > 0:
            self.parser.error(
                "--checkpointing_interval is set and trainer.callbacks has its own ModelCheckpoint: "
                "set every_n_train_steps there, or drop one of the two"
            )
        added.append(CrashCheckpoint())
        return added

    @staticmethod
    def _log_into_the_checkpoints_run(config: Any) -> None:
        ckpt_path = config.get("ckpt_path")
        run = run_version_of(ckpt_path) if ckpt_path else None
        if run is None:
            raise ValueError(
                "--resume_into_run needs a --ckpt_path inside <save_dir>/<name>/version_N/checkpoints/, got "
                f"{ckpt_path!r}"
            )
        logger = config.trainer.get("logger")
        class_path = getattr(logger, "class_path", "") or ""
        if not class_path.endswith(("RunLogger", "TensorBoardLogger")):
            raise ValueError(
                "--resume_into_run continues a TensorBoard run folder: leave --trainer.logger at its default"
            )
        save_dir, name, version = run
        logger.init_args.save_dir, logger.init_args.name, logger.init_args.version = save_dir, name, version
        warnings.filterwarnings("ignore", message="Checkpoint directory .* exists and is not empty")  # it is asked for


def _resolved_ckpt_path(config: Any) -> Optional[str]:
    """``--ckpt_path``, with ``last`` read as the newest checkpoint among the runs under ``--trainer.default_root_dir``
    (else the working folder): their ``last.ckpt``, or the ``crash.ckpt`` a stopped run named."""
    ckpt_path = config.get("ckpt_path")
    if ckpt_path == NEWEST:
        ckpt_path = str(checkpoint_to_resume(config.trainer.get("default_root_dir") or "."))
        rank_zero_info(f"--ckpt_path {NEWEST}: resuming from {ckpt_path}")
    return ckpt_path


def _tokens_per_step(config: Any) -> int:
    """Tokens one process trains on in an optimizer step: windows per batch × their length × micro-batches."""
    accumulate = config.trainer.get("accumulate_grad_batches")
    micro_batches = accumulate if isinstance(accumulate, int) and accumulate > 0 else 1
    return config.data.batch_size * config.data.context_length * micro_batches


def _logs_under_default_root_dir(trainer: Any) -> None:
    """``--trainer.default_root_dir D`` puts the default logger's runs in ``D/logs/lm_systems/version_N`` (as the
    default puts them in ``./logs/...``); a save_dir of the logger's own is kept."""
    logger, root = trainer.get("logger"), trainer.get("default_root_dir")
    default = TRAINER_DEFAULTS["logger"]
    if root is None or getattr(logger, "class_path", None) != default["class_path"]:
        return
    if logger.init_args.save_dir == default["init_args"]["save_dir"]:
        logger.init_args.save_dir = os.path.join(root, default["init_args"]["save_dir"])


def _subcommand_part(config: Any) -> Any:
    """The part of a parsed (or instantiated) configuration that belongs to its subcommand (``fit``), or all of it."""
    subcommand = config.get("subcommand")
    return config[subcommand] if subcommand else config


def _has(items: list[Any], kind: type) -> bool:
    return any(isinstance(item, kind) for item in items)


def check_trainer_choices(trainer: Any, ours: Sequence[str] = ()) -> None:
    """Strategy, precision and accelerator names, checked like a typed flag: an unknown one lists the valid ones
    (``ours``, the registered strategy names the entry point handed in, first); and the device count."""
    from lightning.pytorch.accelerators import AcceleratorRegistry
    from lightning.pytorch.strategies import StrategyRegistry

    lightnings = [name for name in StrategyRegistry.available_strategies() if name not in ours]
    choices = {
        "strategy": ["auto", *ours, *lightnings],
        "precision": precision_names(),
        "accelerator": ["auto", "gpu", *sorted(AcceleratorRegistry.available_accelerators())],
    }
    for name, valid in choices.items():
        value = trainer.get(name)
        # Names only: an object from a YAML config is Lightning's to check.
        if isinstance(value, (str, int)) and str(value) not in valid:
            raise ValueError(f"--{name} (--trainer.{name}) {value!r} is not one of: {', '.join(valid)}")
    devices = trainer.get("devices")
    if isinstance(devices, str) and devices.lstrip("-").isdigit():
        devices = int(devices)
    if isinstance(devices, int):
        valid = devices > 0 or devices == -1
    else:  # a list from a YAML config is Lightning's to check
        valid = not isinstance(devices, str) or devices == "auto" or _DEVICE_LIST.fullmatch(devices) is not None
    if not valid:
        raise ValueError(
            f"--devices (--trainer.devices) {devices!r} is not a count > 0, -1 (all), 'auto' or a list such as '0,1'"
        )
    for name in ("accumulate_grad_batches", "val_check_interval"):
        value = trainer.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 0:
            flag = f"--{name} (--trainer.{name})" if name in SHORT_FLAGS else f"--trainer.{name}"
            raise ValueError(
                f"{flag} {value} must be > 0"
                + (" (batches between validations, or a fraction of an epoch)" if name == "val_check_interval" else "")
            )


_DEVICE_LIST = re.compile(r"\s*\d+\s*(,\s*\d+\s*)*,?\s*")
"""GPU indices as Lightning reads them: '0,1', '1,' (one GPU, index 1)."""


_UNTELLING_LINES = (
    "💡 Tip",  # advertising
    # the model's line says where it trains
    "GPU available:",
    "TPU available:",
    "HPU available:",
    "`Trainer.fit` stopped:",  # printed onto the bar's line; the run's summary says how many steps ran
)


def _quiet_lightning() -> None:
    """Drop Lightning's lines that tell a person nothing ours do not (``_UNTELLING_LINES``), a warning about the
    validation windows' length (they share their batches out among workers) and a deprecation warning that Lightning
    raises against newer torch."""
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(
        lambda record: not str(record.msg).startswith(_UNTELLING_LINES)
    )
    warnings.filterwarnings("ignore", message=r"Your `IterableDataset` has `__len__` defined")
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")


def main(args: Optional[list[str]] = None, run: bool = True, parts: CLIParts = CLIParts()) -> LMCLI:  # noqa: B008  frozen
    """Entry point of ``train.py``, which hands in ``parts``; with no subcommand given, ``fit`` is run. Errors end in
    one line with an exit status (:mod:`lm_systems.errors`): SIGTERM exits with 143 after ``crash.ckpt`` is saved, so a
    scheduler reads the run as interrupted, not finished; Ctrl-C with 130; a run stopped by a non-finite loss or
    weights with 1.

    ``run=False`` parses ``args`` (no subcommand) and builds the model, data and trainer without running.
    """
    given = sys.argv[1:] if args is None else args
    if run and (not given or given[0] not in SUBCOMMANDS):
        if args is None:
            sys.argv.insert(1, "fit")  # LightningCLI reads sys.argv itself when given no args
        else:
            args = ["fit", *args]
    _quiet_lightning()
    set_parsing_settings(docstring_parse_attribute_docstrings=True)  # ModelConfig's field docstrings: --model.* help
    with reported_errors():  # one line and an exit status (lm_systems.errors), not a traceback
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
            parts=parts,
        )
