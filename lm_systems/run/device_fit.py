"""Whether the chosen model fits the chosen accelerator, checked at the door, before any data is prepared.

An attention implementation that cannot run there is refused naming ``--model.attention``; a model too large to
train on a CPU in reasonable time gets a warning naming what it needs, before minutes of silence.
"""

from __future__ import annotations

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


def device_type(accelerator: Any) -> Optional[str]:
    """The torch device type ``--accelerator`` trains on ("cpu", "cuda", …), or None for a configured object."""
    if not isinstance(accelerator, str):
        return None
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if accelerator == "gpu" else accelerator


def check_model_fits_device(model: Any, accelerator: Any) -> None:
    """Refuse an attention that cannot run on ``accelerator``; warn of a model too large for a CPU.

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
        if parameters is not None and parameters > CPU_MAX_PARAMETERS:
            rank_zero_warn(
                f"the model (--model.size {model.size}) has about {parameters / 1e6:.0f}M parameters and trains on a "
                "CPU: expect minutes per step and no output meanwhile. It needs a GPU (--accelerator gpu); on a CPU, "
                "train --model.size tiny (configs/default.yaml)"
            )


def _parameters(model: Any) -> Optional[int]:
    """The parameter count of the model ``model`` describes, counted on the meta device (nothing allocated); None
    when its shape is invalid (LitLM reports that, naming the flag)."""
    try:
        config = ModelConfig.from_name(
            model.size,
            vocab_size=model.vocab_size,  # None: the size's own (the tokenizer's is not known yet)
            context_length=model.context_length,
            d_model=model.d_model,
            num_layers=model.num_layers,
            num_heads=model.num_heads,
            d_ff=model.d_ff,
        )
    except ValueError:
        return None
    with torch.device("meta"):
        return TransformerLM(config).num_parameters()
