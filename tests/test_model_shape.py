"""ModelShape: the named size's vocabulary is a placeholder until given or taken from the data's tokenizer; the data
is checked against the model, naming the flag to change."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from lm_systems.errors import InputError
from lm_systems.model.config import ModelConfig
from lm_systems.model.shape import ModelShape

TINY = ModelConfig(size="tiny", context_length=32, d_model=16, num_layers=1, num_heads=2, d_ff=32)
"""Its vocabulary the size's, a placeholder where none was given."""


def data(vocab_size=None, context_length=16, batch_size=4):
    return SimpleNamespace(vocab_size=vocab_size, context_length=context_length, batch_size=batch_size)


def test_the_vocabulary_is_the_tokenizers_until_one_is_given():
    shape = ModelShape(TINY, vocab_known=False)
    with pytest.raises(RuntimeError, match="--model.vocab_size"):
        _ = shape.config
    assert shape.fit_to_data(data(vocab_size=300)) == 300
    assert shape.config.vocab_size == 300 and shape.data_shape == (4, 16)
    given = ModelShape(replace(TINY, vocab_size=512), vocab_known=True)
    assert given.fit_to_data(data(vocab_size=300)) == 512 and isinstance(given.config, ModelConfig)


@pytest.mark.parametrize(
    "datamodule, flag",
    [(data(vocab_size=600), "--model.vocab_size"), (data(vocab_size=300, context_length=64), "--model.context_length")],
)
def test_data_that_does_not_fit_names_the_flag(datamodule, flag):
    with pytest.raises(InputError, match=flag):
        ModelShape(replace(TINY, vocab_size=512), vocab_known=True).fit_to_data(datamodule)
