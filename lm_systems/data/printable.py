"""Token ids decoded as printable text: what a sample shows on a console and in TensorBoard.

A model early in training emits any byte: a control byte (0x0E) printed as is moves a terminal's state, and bytes
that are no UTF-8 decode to U+FFFD, which hides which bytes they were. Here every byte that is no printable text is
written as its escape (``\\x0e``, ``\\xe2``); line breaks and tabs are kept.
"""

from __future__ import annotations

import functools
import unicodedata

from tokenizers import Tokenizer, decoders

_KEPT_CONTROLS = "\n\t"


def printable_decode(tokenizer: Tokenizer, ids: list[int]) -> str:
    """``ids`` as text, with undecodable bytes and control characters written as ``\\xNN`` escapes.

    A byte-level tokenizer's ids are turned into bytes here (its own decoder would replace bad UTF-8 by U+FFFD);
    special tokens are left out, as ``Tokenizer.decode`` leaves them out.
    """
    if isinstance(tokenizer.decoder, decoders.ByteLevel):
        byte_of = _byte_level_bytes()
        special = {token.content for token in tokenizer.get_added_tokens_decoder().values() if token.special}
        tokens = [tokenizer.id_to_token(i) for i in ids]
        data = bytes(byte_of[char] for token in tokens if token not in special for char in token)
        text = data.decode("utf-8", errors="backslashreplace")
    else:
        text = tokenizer.decode(ids)
    return "".join(_printable(char) for char in text)


def _printable(char: str) -> str:
    if char in _KEPT_CONTROLS or unicodedata.category(char) != "Cc":
        return char
    return f"\\x{ord(char):02x}"  # every control character is below U+00A0


@functools.cache
def _byte_level_bytes() -> dict[str, int]:
    """The byte each character of a byte-level BPE's alphabet stands for (GPT-2's mapping: printable bytes are
    themselves, the others are shifted past U+00FF in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = (byte for byte in range(256) if byte not in printable)
    mapping = {chr(byte): byte for byte in printable}
    mapping |= {chr(256 + index): byte for index, byte in enumerate(shifted)}
    return mapping
