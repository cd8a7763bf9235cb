"""The checks made at the door: after parsing, before any data is prepared, model built or folder of the run made.

Each names the flag to change in one line, where the failure would otherwise come late or deep: a YAML error
without its file's name, a strategy name as a dump of jsonargparse's Union subtypes, synthetic data that silently
ignored ``--data.corpus`` or tried to allocate 512 GB for ``--data.vocab_size``, an 8B model whose CPU step took
hours in silence, a log folder Lightning's logger could not make.
"""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any, Optional

import torch
import yaml
from lightning.pytorch.utilities import rank_zero_warn

from lm_systems.attention.registry import attention_device_problem
from lm_systems.data.datamodule import LMDataModule
from lm_systems.errors import InputError
from lm_systems.model.config import ModelConfig
from lm_systems.model.transformer import TransformerLM

CPU_MAX_PARAMETERS = 20_000_000
"""Past this many parameters a CPU run is warned about: `tiny` (a few million) is the CPU's model."""
CPU_FLOPS_PER_S = 2e11
"""A CPU's training speed as the step estimate assumes it: the default tiny run's on two cores at 6 FLOPs per
parameter and token (benchmarks/results/default_run_cpu.md). Larger models are not faster: the estimate errs towards
starting."""
TRAINING_FLOPS_PER_PARAMETER_TOKEN = 6  # forward 2, backward 4; attention left out: a lower bound
TRAINED_BYTES_PER_PARAMETER = 16  # fp32 weight, gradient and AdamW's two moments
_DEVICE_LIST = re.compile(r"\s*\d+\s*(,\s*\d+\s*)*,?\s*")  # GPU indices as Lightning reads them: '0,1', '1,'


def check_config_files(args: Sequence[str]) -> None:
    """A config file (``-c F``, ``--config F``, ``--config=F``) that is not UTF-8, YAML or a mapping, named with its
    flag, line and column (jsonargparse names neither the file nor the flag). A missing file is jsonargparse's."""
    given = [(a, args[i + 1]) for i, a in enumerate(args[:-1]) if a in ("-c", "--config")]
    given += [("--config", a.split("=", 1)[1]) for a in args if a.startswith("--config=")]
    for flag, name in given:
        if not Path(name).is_file():
            continue  # a YAML string after -c is allowed too
        try:
            value = yaml.safe_load(Path(name).read_text(encoding="utf-8"))
        except UnicodeDecodeError as error:
            raise InputError(f"{flag} {name!r} is not UTF-8 text (byte {error.start})") from error
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(error, "problem", None) or str(error).splitlines()[0]
            raise InputError(f"{flag} {name!r} is not valid YAML{where}: {problem}; fix the file") from error
        if value is not None and not isinstance(value, dict):
            raise InputError(
                f"{flag} {name!r} holds a YAML {type(value).__name__}, not a mapping of keys such as "
                "'model:' and 'trainer:'"
            )


def check_trainer_choices(trainer: Any, ours: Sequence[str] = (), short_flags: Sequence[str] = ()) -> None:
    """Strategy and accelerator names, checked like a typed flag: an unknown one lists the valid ones
    (``ours``, the strategy names the entry point registered, first); then the device count and the intervals.
    An object from a YAML config is Lightning's to check."""
    from lightning.pytorch.accelerators import AcceleratorRegistry
    from lightning.pytorch.strategies import StrategyRegistry

    choices = {
        "strategy": ["auto", *ours, *(name for name in StrategyRegistry.available_strategies() if name not in ours)],
        "accelerator": ["auto", "gpu", *sorted(AcceleratorRegistry.available_accelerators())],
    }
    for name, valid in choices.items():
        value = trainer.get(name)
        if isinstance(value, (str, int)) and str(value) not in valid:
            raise InputError(f"--{name} (--trainer.{name}) {value!r} is not one of: {', '.join(valid)}")
    devices = trainer.get("devices")
    if isinstance(devices, str) and devices.lstrip("-").isdigit():
        devices = int(devices)
    if (
        isinstance(devices, int)
        and not (devices > 0 or devices == -1)
        or (isinstance(devices, str) and devices != "auto" and not _DEVICE_LIST.fullmatch(devices))
    ):
        raise InputError(
            f"--devices (--trainer.devices) {devices!r} is not a count > 0, -1 (all), 'auto' or a list such as '0,1'"
        )
    for name in ("accumulate_grad_batches", "val_check_interval"):
        value = trainer.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 0:
            flag = f"--{name} (--trainer.{name})" if name in short_flags else f"--trainer.{name}"
            why = " (batches between validations, or a fraction of an epoch)" if name == "val_check_interval" else ""
            raise InputError(f"{flag} {value} must be > 0{why}")


def check_data_settings(data: Any, model: Any, accelerator: Any) -> None:
    """Synthetic data (``data``, ``model``: the parsed parts) with corpus flags, which it does not read, or with a
    vocabulary of fewer than 2 ids or too large to embed in ``accelerator``'s memory."""
    if not data.synthetic:
        return
    defaults = inspect.signature(LMDataModule.__init__).parameters
    for key in ("corpus", "tokenizer"):
        if data.get(key) != defaults[key].default:
            raise InputError(
                f"--data.{key} {data.get(key)!r} is not read with --data.synthetic true (random token ids): drop one "
                "of the two"
            )
    if data.vocab_size < 2:
        raise InputError(
            f"--data.vocab_size {data.vocab_size} is not a vocabulary: synthetic tokens need at least 2 ids; pass e.g. "
            "--data.vocab_size 50257"
        )
    if model.vocab_size is not None:  # the data's vocabulary is the model's unless the model has its own
        return
    try:
        d_model = ModelConfig.from_name(model.size, d_model=model.d_model).d_model
    except ValueError:
        return  # LitLM names the flag
    device = device_type(accelerator)
    memory = _device_memory(device)
    needed = 2 * data.vocab_size * d_model * TRAINED_BYTES_PER_PARAMETER  # the embedding and the LM head
    if memory is not None and needed > memory:
        raise InputError(
            f"--data.vocab_size {data.vocab_size} is past what the model can embed here: its embedding and LM head at "
            f"d_model {d_model} need {needed / 1e9:,.0f} GB for weights, gradients and AdamW state, more than the "
            f"{device}'s {memory / 1e9:,.0f} GB; pass a smaller --data.vocab_size"
        )


def check_model_fits_device(
    model: Any, accelerator: Any, tokens_per_step: int = 0, cpu_step_limit_s: float = 0
) -> None:
    """Refuse an attention that cannot run on ``accelerator``, and on a CPU a step estimated to take longer than
    ``cpu_step_limit_s`` (0: no limit) at ``tokens_per_step`` tokens per process; warn of a model too large for a CPU.
    ``model``: the parsed ``model`` part of the configuration."""
    device = device_type(accelerator)
    if device is None:
        return
    problem = attention_device_problem(model.attention, device)
    if problem is not None:
        raise InputError(
            f"--model.attention {model.attention} cannot run on --accelerator {accelerator} ({device}): "
            f"{problem}; pass --model.attention sdpa (or auto), or train on a GPU"
        )
    if device != "cpu":
        return
    parameters = _parameters(model)
    flops = TRAINING_FLOPS_PER_PARAMETER_TOKEN * (parameters or 0) * tokens_per_step
    seconds = flops / CPU_FLOPS_PER_S
    if 0 < cpu_step_limit_s < seconds:
        took = f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"
        raise InputError(
            f"--model.size {model.size} at {tokens_per_step:,} tokens a step needs about {flops:.2g} FLOPs a step: "
            f"about {took} on a CPU at {CPU_FLOPS_PER_S:.0e} FLOP/s, past --cpu_step_limit_s "
            f"{cpu_step_limit_s:g}; train it on a GPU (--accelerator gpu), train --model.size tiny on the CPU, or "
            "raise --cpu_step_limit_s (0: no limit)"
        )
    if parameters is not None and parameters > CPU_MAX_PARAMETERS:
        rank_zero_warn(
            f"the model (--model.size {model.size}) has about {parameters / 1e6:.0f}M parameters and trains on a "
            "CPU: expect minutes per step and no output meanwhile. It needs a GPU (--accelerator gpu); on a CPU, "
            "train --model.size tiny (configs/default.yaml)"
        )


def make_output_folder(path: Optional[str], flag: str) -> None:
    """Create ``path`` (unset: nothing) and its parents, or name ``flag`` when it cannot be made."""
    if path is None:
        return
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise InputError(f"{flag} {path!r} cannot be made ({reason}): pass a folder you can write to") from error


def device_type(accelerator: Any) -> Optional[str]:
    """The torch device type ``--accelerator`` trains on ("cpu", "cuda", …), or None for a configured object."""
    if not isinstance(accelerator, str):
        return None
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if accelerator == "gpu" else accelerator


def _device_memory(device: Optional[str]) -> Optional[int]:
    if device == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    return None


def _parameters(model: Any) -> Optional[int]:
    """The parameter count of the model ``model`` describes, on the meta device; None for a shape LitLM refuses."""
    try:  # the vocabulary left unset is the size's own: the tokenizer's is not known yet
        config = ModelConfig(**{f.name: model.get(f.name) for f in fields(ModelConfig) if f.name in model})
    except ValueError:
        return None
    with torch.device("meta"):
        return TransformerLM(config).num_parameters()
