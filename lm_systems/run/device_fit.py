"""Whether the chosen model fits the chosen accelerator, checked at the door, before any data is prepared.

An attention implementation that cannot run there is refused naming ``--model.attention``; on a CPU, a step that
would take longer than ``--cpu_step_limit_s`` is refused (an 8B model's took hours, silent, after a warning), and a
model past ``CPU_MAX_PARAMETERS`` gets a warning naming what it needs, before minutes of silence.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Optional

import torch
from lightning.pytorch.utilities import rank_zero_warn

from lm_systems.attention.registry import attention_device_problem
from lm_systems.errors import InputError
from lm_systems.model.config import ModelConfig
from lm_systems.model.transformer import TransformerLM

CPU_MAX_PARAMETERS = 20_000_000
"""Past this many parameters a CPU run is warned about: the `tiny` size (a few million) is the CPU's model, and
a step's time grows with the parameter count (configs/small.yaml says what a step of GPT-2 small took)."""


CPU_FLOPS_PER_S = 2e11
"""A CPU's training speed as the step estimate assumes it: what the default tiny run reached on two cores, at 6 FLOPs
per parameter per token (benchmarks/results/default_run_cpu.md: 8,800 tokens/s × 3.6M parameters × 6). Larger
models are not faster on a CPU, so the estimate errs towards letting a run start."""
TRAINING_FLOPS_PER_PARAMETER_TOKEN = 6
"""Forward (2) and backward (4) multiply-adds per parameter and token, attention left out: a lower bound."""


def device_type(accelerator: Any) -> Optional[str]:
    """The torch device type ``--accelerator`` trains on ("cpu", "cuda", …), or None for a configured object."""
    if not isinstance(accelerator, str):
        return None
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if accelerator == "gpu" else accelerator


def check_model_fits_device(
    model: Any, accelerator: Any, tokens_per_step: int = 0, cpu_step_limit_s: float = 0
) -> None:
    """Refuse an attention that cannot run on ``accelerator``, and on a CPU a step estimated to take longer than
    ``cpu_step_limit_s`` (0: no limit) at ``tokens_per_step`` tokens per process; warn of a model too large for a CPU.

    ``model`` is the parsed ``model`` part of the configuration (LitLM's arguments).
    """
    device = device_type(accelerator)
    if device is None:
        return
    problem = attention_device_problem(model.attention, device)
    if problem is not None:
        raise InputError(
            f"--model.attention {model.attention} cannot run on --accelerator {accelerator} ({device}): "
            f"{problem}; pass --model.attention sdpa (or auto), or train on a GPU"
        )
    if device == "cpu":
        parameters = _parameters(model)
        flops = TRAINING_FLOPS_PER_PARAMETER_TOKEN * (parameters or 0) * tokens_per_step
        seconds = flops / CPU_FLOPS_PER_S
        if cpu_step_limit_s > 0 and seconds > cpu_step_limit_s:
            raise InputError(
                f"--model.size {model.size} at {tokens_per_step:,} tokens a step needs about {flops:.2g} FLOPs a step: "
                f"about {_duration(seconds)} on a CPU at {CPU_FLOPS_PER_S:.0e} FLOP/s, past --cpu_step_limit_s "
                f"{cpu_step_limit_s:g}; train it on a GPU (--accelerator gpu), train --model.size tiny on the CPU, or "
                "raise --cpu_step_limit_s (0: no limit)"
            )
        if parameters is not None and parameters > CPU_MAX_PARAMETERS:
            rank_zero_warn(
                f"the model (--model.size {model.size}) has about {parameters / 1e6:.0f}M parameters and trains on a "
                "CPU: expect minutes per step and no output meanwhile. It needs a GPU (--accelerator gpu); on a CPU, "
                "train --model.size tiny (configs/default.yaml)"
            )


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def _parameters(model: Any) -> Optional[int]:
    """The parameter count of the model ``model`` describes, counted on the meta device (nothing allocated); None
    when its shape is invalid (LitLM reports that, naming the flag)."""
    try:
        # The vocabulary left unset is the size's own here: the tokenizer's is not known yet.
        config = ModelConfig(**{f.name: model.get(f.name) for f in fields(ModelConfig) if f.name in model})
    except ValueError:
        return None
    with torch.device("meta"):
        return TransformerLM(config).num_parameters()
