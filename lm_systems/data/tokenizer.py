"""Byte-level BPE tokenizer (the `tokenizers` library): train, save as tokenizer.json, load, fingerprint."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable, Optional

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from lm_systems.data.checksums import checked_writer
from lm_systems.errors import InputError

END_OF_TEXT = "<|endoftext|>"
"""Separates documents in the token stream; the tokenizer keeps it as one special token."""


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE with at most ``vocab_size`` tokens (256 bytes + ``<|endoftext|>`` + merges).

    Byte level: every string encodes (no unknown token) and decodes back exactly. Training stops early
    when no pair occurs twice, so a small corpus yields fewer tokens than asked for.
    """
    minimum = len(pre_tokenizers.ByteLevel.alphabet()) + 1
    if vocab_size < minimum:
        raise InputError(f"--data.vocab_size must be at least {minimum} (256 bytes + {END_OF_TEXT}), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    # No normaliser and no prefix space: the text is kept byte for byte, so decode(encode(s)) == s.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Training does not split out special tokens by itself: without this, merges such as "<|" waste the vocabulary.
    pieces = (piece for text in texts for piece in text.split(END_OF_TEXT))
    tokenizer.train_from_iterator(pieces, trainer=trainer)
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, path: str | Path) -> Path:
    """Write ``tokenizer`` as ``path`` (a tokenizer.json), with a checksum (``checksums.sidecar_damage`` checks it)."""
    path = Path(path)
    with checked_writer(path) as file:
        file.write(tokenizer.to_str(pretty=True).encode())
    return path


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer in ``path`` (a tokenizer.json), which must know ``<|endoftext|>``; errors name --data.tokenizer."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"--data.tokenizer {str(path)!r} does not exist (pass a tokenizer.json, or leave it unset to train one)"
        )
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as error:  # the Rust side raises a bare Exception on a malformed file
        raise InputError(f"--data.tokenizer {str(path)!r} is not a readable tokenizer.json: {error}") from error
    if tokenizer.token_to_id(END_OF_TEXT) is None:
        raise InputError(f"--data.tokenizer {str(path)!r} has no {END_OF_TEXT} token to separate documents with")
    return tokenizer


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """Hash of the tokenizer's full serialisation: any change to vocab, merges or settings changes it."""
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()[:16]


def tokenizer_mismatch(saved: Optional[str], current: Optional[str]) -> Optional[str]:
    """Why text tokenized by ``current`` (serialised) cannot continue a model trained with ``saved``, or None."""
    if saved is None or current is None or saved == current:
        return None

    def describe(text: str) -> str:
        tokenizer = Tokenizer.from_str(text)
        return f"{tokenizer.get_vocab_size()} tokens, fingerprint {tokenizer_fingerprint(tokenizer)}"

    return (
        f"the data's tokenizer ({describe(current)}) is not the checkpoint's ({describe(saved)}): the model's ids "
        "would mean other text; resume with the --data.corpus, --data.vocab_size and --data.tokenizer it was "
        "trained with"
    )
