"""Resuming continues the run, with what was typed: the checkpoint's settings under the command line, never over it.

LightningCLI parses a checkpoint's model hyperparameters over the command line (every typed ``--model.*`` was
dropped), and knows nothing of the run's other settings (``--ckpt_path X`` alone resumed a two-process zero3 run as
one process). Here the layers are, later winning: the parser's defaults, the checkpoint's model hyperparameters and
the run's other settings (``RunConfigRecord`` stores them in each checkpoint), then config files and flags. Objects
that are not plain values (callbacks, a logger's settings) are the command line's. What fixes the model's shape
(``SHAPE_KEYS``) must match; the tokenizer is compared once the data is ready (``LitLM.on_load_checkpoint``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from jsonargparse import Namespace
from lightning.pytorch.utilities import rank_zero_info

from lm_systems.errors import InputError
from lm_systems.files.checkpoint_dir import is_checkpoint_dir, read_meta
from lm_systems.files.checkpoint_io import NEWEST, newest_run_checkpoint
from lm_systems.files.checkpointing import CRASH_CHECKPOINT
from lm_systems.model.config import ModelConfig
from lm_systems.training.nonfinite import weights_are_finite

SHAPE_KEYS = ("size", "vocab_size", "context_length", "d_model", "num_layers", "num_heads", "d_ff", "rope_theta")
CRASH_CHECKPOINTS = f"logs/*/version_*/checkpoints/{CRASH_CHECKPOINT}"  # under the working or default_root_dir
RUN_CONFIG_KEY = "run_config"
"""Checkpoint entry holding the run's flat settings (model ones aside: ``hyper_parameters`` has those, resolved)."""
_NOT_SETTINGS = ("ckpt_path", "config", "resume_into_run", "debug", "trainer.logger.")  # this invocation, not the run
_DERIVED = ("data.context_length",)  # linked arguments: never layered, they follow their sources


def resolved_ckpt_path(ckpt_path: Optional[str], root: Optional[str]) -> Optional[str]:
    """``--ckpt_path``, with ``last`` read as the newest checkpoint among the runs under ``root`` (else the working
    folder): their ``last.ckpt`` or the ``crash.ckpt`` a stopped run names (one stopped before its first
    ``step=N.ckpt`` has no ``last.ckpt``); an error naming the flag if there is none."""
    if ckpt_path != NEWEST:
        return ckpt_path
    crashes = [path for path in Path(root or ".").glob(CRASH_CHECKPOINTS) if path.exists()]
    try:
        lasts = [newest_run_checkpoint(root or ".", "--ckpt_path")]
    except FileNotFoundError:
        if not crashes:
            raise
        lasts = []
    newest = str(max([*lasts, *crashes], key=lambda path: path.stat().st_mtime))
    rank_zero_info(f"--ckpt_path {NEWEST}: {newest}")
    return newest


class SavedSettings:
    """The settings a checkpoint was written with: its model hyperparameters and the run's other settings."""

    def __init__(self, ckpt_path: str | Path) -> None:
        self.path = str(ckpt_path)
        checkpoint = (
            read_meta(ckpt_path)  # its weights were checked finite before they were written
            if is_checkpoint_dir(ckpt_path)
            else torch.load(ckpt_path, map_location="cpu", mmap=True, weights_only=True)
        )
        if not weights_are_finite((checkpoint.get("state_dict") or {}).values()):
            raise InputError(
                f"--ckpt_path {self.path!r} holds non-finite weights (NaN or inf): training cannot continue from it; "
                "pass an earlier checkpoint of that run (its step=N.ckpt files), or train without --ckpt_path"
            )
        self.global_step: int | None = checkpoint.get("global_step")
        self.hparams = {k: v for k, v in (checkpoint.get("hyper_parameters") or {}).items() if not k.startswith("_")}
        self.run_settings = {k: v for k, v in (checkpoint.get(RUN_CONFIG_KEY) or {}).items() if k not in _DERIVED}
        self.settings = {**self.run_settings, **{f"model.{k}": v for k, v in self.hparams.items()}}

    def under(self, parser: Any, args: Any, config: Namespace) -> Namespace:
        """``config`` parsed again from ``args`` over the checkpoint's settings; a typed setting that would change the
        model's shape is refused, naming the flag and both values."""
        if not self.settings:
            return config
        subcommand = config.get("subcommand")
        prefix = f"{subcommand}." if subcommand else ""
        layer = Namespace()
        for key, value in self.settings.items():
            if _known(f"{prefix}{key}", config):  # a key an older version had and this one lacks is dropped
                layer[f"{prefix}{key}"] = value
        resumed = parser.parse_args(args, namespace=layer)
        self._refuse_shape_changes((resumed[subcommand] if subcommand else resumed).model)
        return resumed

    def refuse_a_finished_run(self, max_steps: Any) -> None:
        """Raise InputError when the checkpoint's step is already ``max_steps`` (the run's, or the one typed): Lightning
        would restore it, train nothing and end without a word."""
        if self.global_step is None or not isinstance(max_steps, int) or max_steps < 0:
            return
        if self.global_step >= max_steps:
            raise InputError(
                f"--ckpt_path {self.path!r} is at step {self.global_step}, where --max_steps {max_steps} ends the run: "
                f"nothing is left to train; pass a larger --max_steps (--trainer.max_steps) to train on"
            )

    def log_changes(self, run: Namespace) -> None:
        """Log each setting of ``run`` (one subcommand's config) that differs from the checkpoint's."""
        changes = changed_settings(self.settings, flat_settings(run))
        if changes:
            rank_zero_info(
                f"resuming from {self.path!r} with settings changed since it was saved: {', '.join(changes)}"
            )

    def _refuse_shape_changes(self, typed: Namespace) -> None:
        def shape(values: dict[str, Any]) -> ModelConfig:
            return ModelConfig(**{k: values.get(k) for k in SHAPE_KEYS})

        saved = self.hparams
        differing = [key for key in SHAPE_KEYS if key in saved and typed.get(key) != saved[key]]
        typed_shape, saved_shape = shape(dict(typed.items())), shape(saved)
        if differing and typed_shape != saved_shape:
            key = differing[0]
            # Resolved values: an unset field (None) stands for the size's own, which is what the model was built with.
            values = (
                (typed.get(key), saved[key])
                if key == "size"
                else (getattr(typed_shape, key), getattr(saved_shape, key))
            )
            raise ValueError(
                f"--model.{key} {values[0]!r} does not match the checkpoint's {values[1]!r} ({self.path!r}): "
                f"a resumed run keeps the model's shape ({', '.join(SHAPE_KEYS)}); drop --model.{key}, or train a "
                "new model without --ckpt_path"
            )


def _known(key: str, config: Namespace) -> bool:
    """Whether ``key`` is one of ``config``'s, or lies below one of its values that is not a namespace:
    ``trainer.strategy.init_args.x`` below a strategy given by name (the layered class replaces the name)."""
    if key in config:
        return True
    parts = key.split(".")
    for end in range(len(parts) - 1, 0, -1):
        above = ".".join(parts[:end])
        if above in config:
            return not isinstance(config[above], Namespace)
    return False


def flat_settings(config: Namespace) -> dict[str, Any]:
    """The run's settings as ``{"trainer.max_steps": 300, ...}``: plain values only (no callbacks or objects), and
    a short flag's value under the trainer's key only (``--max_steps`` is ``--trainer.max_steps``)."""

    def plain(value: Any) -> bool:
        if isinstance(value, (list, tuple)):
            return all(plain(v) for v in value)
        return value is None or isinstance(value, (str, int, float, bool))

    return {
        key: value
        for key, value in config.items()
        if plain(value) and not key.startswith(_NOT_SETTINGS) and f"trainer.{key}" not in config
    }


def changed_settings(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """``["model.lr 30.0 → 0.001", ...]`` for each setting in both whose value differs."""

    def same(a: Any, b: Any) -> bool:
        return list(a) == list(b) if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) else a == b

    return [f"{key} {before[key]!r} → {now[key]!r}" for key in now if key in before and not same(before[key], now[key])]
