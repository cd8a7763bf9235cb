"""Byte-level BPE: exact round trips on any text, one id for <|endoftext|>, clear errors naming --data.tokenizer."""

from __future__ import annotations

import random

import pytest

from lm_systems.data.checksums import sidecar
from lm_systems.data.tokenizer import (
    END_OF_TEXT,
    load_tokenizer,
    save_tokenizer,
    tokenizer_fingerprint,
    train_bpe_tokenizer,
)


def random_unicode_text(rng: random.Random, length: int) -> str:
    """Code points from several scripts, emoji, control characters and whitespace runs."""
    ranges = [(0x20, 0x7E), (0x00, 0x1F), (0xA0, 0x17F), (0x3040, 0x30FF), (0x4E00, 0x4FFF), (0x1F300, 0x1F64F)]
    chars = []
    for _ in range(length):
        low, high = rng.choice(ranges)
        chars.append(chr(rng.randint(low, high)))
    return "".join(chars)


@pytest.mark.parametrize("seed", range(4))
def test_round_trip_is_exact_on_random_unicode(small_tokenizer, seed):
    rng = random.Random(seed)
    for length in (0, 1, 7, 131):
        text = random_unicode_text(rng, length)
        ids = small_tokenizer.encode(text).ids
        assert small_tokenizer.decode(ids, skip_special_tokens=False) == text


def test_round_trip_keeps_spaces_newlines_and_the_special_token(small_tokenizer):
    text = f"  Two leading spaces.\n\n\ttab, café 日本 🙂{END_OF_TEXT}Next doc{END_OF_TEXT}{END_OF_TEXT} end \n"
    encoding = small_tokenizer.encode(text)
    eot_id = small_tokenizer.token_to_id(END_OF_TEXT)
    assert encoding.ids.count(eot_id) == 3, "each <|endoftext|> must be a single special id"
    assert small_tokenizer.decode(encoding.ids, skip_special_tokens=False) == text


def test_training_learns_merges_up_to_the_target(documents, small_tokenizer):
    assert small_tokenizer.get_vocab_size() == 320  # 256 bytes + <|endoftext|> + 63 merges
    text = documents[0]
    assert len(small_tokenizer.encode(text).ids) < len(text.encode()), "merges should compress the text"


def test_training_keeps_the_special_token_out_of_the_merges(documents):
    tokenizer = train_bpe_tokenizer([f"{doc}\n{END_OF_TEXT}" for doc in documents], vocab_size=400)
    pieces = [token for token in tokenizer.get_vocab() if token != END_OF_TEXT]
    assert not any("endoftext" in token or "<|" in token or "|>" in token for token in pieces)


def test_vocab_smaller_than_the_byte_alphabet_is_refused(documents):
    with pytest.raises(ValueError, match="--data.vocab_size"):
        train_bpe_tokenizer(documents, vocab_size=200)


def test_save_and_load_give_the_same_tokenizer(tmp_path, small_tokenizer, documents):
    path = save_tokenizer(small_tokenizer, tmp_path / "nested" / "tokenizer.json")
    loaded = load_tokenizer(path)
    assert tokenizer_fingerprint(loaded) == tokenizer_fingerprint(small_tokenizer)
    assert loaded.encode(documents[3]).ids == small_tokenizer.encode(documents[3]).ids
    assert sorted(path.parent.iterdir()) == [path, sidecar(path)], "no temporary file may be left behind"


def test_fingerprint_changes_with_the_vocabulary(documents, small_tokenizer):
    other = train_bpe_tokenizer(documents, vocab_size=330)
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(small_tokenizer)


def test_missing_tokenizer_names_the_flag(tmp_path):
    with pytest.raises(FileNotFoundError, match="--data.tokenizer"):
        load_tokenizer(tmp_path / "nope.json")


def test_unreadable_tokenizer_names_the_flag(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text('{"this is": "not a tokenizer"')
    with pytest.raises(ValueError, match="--data.tokenizer .* not a readable tokenizer.json"):
        load_tokenizer(path)


def test_tokenizer_without_end_of_text_is_refused(tmp_path):
    from tokenizers import Tokenizer, models

    path = tmp_path / "tokenizer.json"
    Tokenizer(models.BPE()).save(str(path))
    with pytest.raises(ValueError, match=r"--data.tokenizer .* no <\|endoftext\|>"):
        load_tokenizer(path)
