"""Samples are printable: control bytes and bytes that are no UTF-8 show as escapes, on the console and in TensorBoard
alike (both print ``sample_text``); ordinary text, line breaks and tabs are as they were."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tokenizers import pre_tokenizers

from lm_systems.data.printable import printable_decode
from lm_systems.data.tokenizer import train_bpe_tokenizer
from lm_systems.training.sampling import sample_text

PROMPT = "Once upon"


@pytest.fixture(scope="module")
def tokenizer(documents):
    return train_bpe_tokenizer(documents, vocab_size=320)


def byte_ids(tokenizer, text: str) -> list[int]:
    """One id per UTF-8 byte of ``text``: the byte-level alphabet's own tokens, as the library's pre-tokenizer
    spells each byte."""
    pieces = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(text)
    return [tokenizer.token_to_id(char) for piece, _ in pieces for char in piece]


class ScriptedModel(torch.nn.Module):
    """Emits ``script``'s ids one after another (as argmax), whatever the input."""

    def __init__(self, script: list[int], vocab_size: int) -> None:
        super().__init__()
        self.script, self.vocab_size, self.calls = script, vocab_size, 0
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.config = SimpleNamespace(context_length=64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(1, ids.shape[1], self.vocab_size)
        logits[0, -1, self.script[self.calls]] = 1.0
        self.calls += 1
        return logits


def test_a_sample_of_control_and_broken_bytes_prints_them_as_escapes(tokenizer):
    continuation = byte_ids(tokenizer, " bestR\x0e schoolJane\tsaid\n日本")[:-2]  # 本's last two bytes cut off
    model = ScriptedModel(continuation, tokenizer.get_vocab_size())
    text = sample_text(model, tokenizer, PROMPT, max_new_tokens=len(continuation), temperature=0)
    expected = PROMPT + " bestR\\x0e schoolJane\tsaid\n日\\xe6"
    assert text == expected
    assert all(c.isprintable() or c in "\n\t" for c in text)


def test_ordinary_text_decodes_as_the_tokenizer_decodes_it(tokenizer, documents):
    for document in documents[:20]:
        ids = tokenizer.encode(document).ids
        assert printable_decode(tokenizer, ids) == tokenizer.decode(ids) == document
