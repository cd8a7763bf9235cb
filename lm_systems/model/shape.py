"""The shape of the model a LitLM trains: its ``ModelConfig``, the vocabulary taken from the data's tokenizer where
unset, checked against the data (the tokenizer's tokens, the windows' length)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from lm_systems.errors import InputError
from lm_systems.model.config import ModelConfig

DataShape = tuple[Optional[int], Optional[int]]
"""(batch size, context) of the data's windows."""


class ModelShape:
    """``config`` (checked when made, the attention's name included) with its vocabulary the data's where
    ``vocab_known`` is false: until then the size's vocabulary stands in for it."""

    def __init__(self, config: ModelConfig, vocab_known: bool) -> None:
        self._config = config
        self._vocab_known = vocab_known
        self.data_shape: Optional[DataShape] = None  # from fit_to_data

    @property
    def config(self) -> ModelConfig:
        """The model's configuration, once its vocabulary is known."""
        if not self._vocab_known:
            raise RuntimeError(
                "the model's vocabulary is not known yet: it is the datamodule's tokenizer's, taken "
                "when a Trainer sets this module up (or set --model.vocab_size)"
            )
        return self._config

    def fit_to_data(self, datamodule: Any) -> int:
        """Take the datamodule's tokenizer vocabulary where none was given, and its batch shape; an error naming the
        flag where the data does not fit the model. The vocabulary trained with."""
        data_vocab = getattr(datamodule, "vocab_size", None)
        data_context = getattr(datamodule, "context_length", None)
        if not self._vocab_known:
            if data_vocab is None:
                raise ValueError("model.vocab_size is unset and the datamodule has no tokenizer to take it from")
            self._config, self._vocab_known = replace(self._config, vocab_size=data_vocab), True
        if data_vocab is not None and data_vocab > self._config.vocab_size:
            raise InputError(
                f"the tokenizer has {data_vocab} tokens but model.vocab_size is {self._config.vocab_size}: raise "
                "--model.vocab_size (or leave it unset to follow the tokenizer); resuming from a checkpoint, use the "
                "--data.corpus, --data.vocab_size and --data.tokenizer it was trained with"
            )
        if data_context is not None and data_context > self._config.context_length:
            raise InputError(
                f"data windows of {data_context} tokens exceed the model's context_length "
                f"{self._config.context_length}: set --model.context_length to at least {data_context}"
            )
        self.data_shape = (getattr(datamodule, "batch_size", None), data_context)
        return self._config.vocab_size
