"""The data flags, checked at the door, before any data is prepared or model built.

With ``--data.synthetic true`` the corpus flags are not read (a typed ``--data.corpus`` was silently ignored) and
``--data.vocab_size`` is the model's vocabulary itself: 0 failed deep in the model, 10⁹ tried to allocate 512 GB.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch

from lm_systems.data.datamodule import LMDataModule
from lm_systems.errors import InputError
from lm_systems.model.config import ModelConfig
from lm_systems.run.device_fit import device_type

TRAINED_BYTES_PER_PARAMETER = 16
"""An fp32 parameter in training: the weight, its gradient and AdamW's two moments, 4 bytes each."""


def check_data_settings(data: Any, model: Any, accelerator: Any) -> None:
    """Refuse synthetic data with corpus flags, or with a vocabulary of fewer than 2 ids or too large to embed in
    ``accelerator``'s memory. ``data`` and ``model``: the parsed ``data`` and ``model`` parts of the configuration."""
    if not data.synthetic:
        return
    defaults = inspect.signature(LMDataModule.__init__).parameters
    for key in ("corpus", "tokenizer"):
        if data.get(key) != defaults[key].default:
            raise InputError(
                f"--data.{key} {data.get(key)!r} is not read with --data.synthetic true (random token ids): drop one "
                "of the two"
            )
    vocab_size = data.vocab_size
    if vocab_size < 2:
        raise InputError(
            f"--data.vocab_size {vocab_size} is not a vocabulary: synthetic tokens need at least 2 ids; pass e.g. "
            "--data.vocab_size 50257"
        )
    if model.vocab_size is None:  # the data's vocabulary is the model's
        _check_vocabulary_fits(vocab_size, model, accelerator)


def _check_vocabulary_fits(vocab_size: int, model: Any, accelerator: Any) -> None:
    try:
        d_model = ModelConfig.from_name(model.size, d_model=model.d_model).d_model
    except ValueError:
        return  # LitLM names the flag
    device = device_type(accelerator)
    memory = _device_memory(device)
    needed = 2 * vocab_size * d_model * TRAINED_BYTES_PER_PARAMETER  # the embedding and the LM head
    if memory is not None and needed > memory:
        raise InputError(
            f"--data.vocab_size {vocab_size} is past what the model can embed here: its embedding and LM head at "
            f"d_model {d_model} need {needed / 1e9:,.0f} GB for weights, gradients and AdamW state, more than the "
            f"{device}'s {memory / 1e9:,.0f} GB; pass a smaller --data.vocab_size"
        )


def _device_memory(device: Any) -> int | None:
    """Bytes of memory of ``device`` ("cpu": the host's; "cuda": the first GPU's), None when unknown."""
    if device == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    return None
