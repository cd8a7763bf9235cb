"""Sample text from a training checkpoint (the sampling itself is lm_systems.training.sampling's).

python -m lm_systems.generate --ckpt last --prompt "Once upon a time"    # the newest run's last.ckpt
python -m lm_systems.generate --ckpt logs/lm_systems/version_3/checkpoints/step=300.ckpt
(a checkpoint directory, as zero3, zero1 and fsdp2 write, is read the same way: its weights only)
"""

from __future__ import annotations

import argparse
import io
import math
import sys
from pathlib import Path
from typing import Callable

import torch
from tokenizers import Tokenizer

from lm_systems.errors import DEBUG_ENV, reported_errors, request_debug
from lm_systems.files.checkpoint_dir import is_checkpoint_dir, read_whole
from lm_systems.files.checkpoint_io import NEWEST, RUN_CHECKPOINTS, newest_run_checkpoint, require_checkpoint_file
from lm_systems.lit_module import LitLM
from lm_systems.model.transformer import TransformerLM
from lm_systems.training.sampling import sample_text


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> tuple[TransformerLM, Tokenizer]:
    """The model and tokenizer stored in a LitLM checkpoint, the model on ``device``, with an error naming --ckpt
    if it can't be read.

    The model is rebuilt by ``LitLM.load_from_checkpoint`` from the checkpoint's hyperparameters (the vocabulary
    resolved at training time included), uncompiled: each new length of a growing sample would recompile it.
    The checkpoint is read into host memory and only the weights move to ``device``: its optimizer state (twice
    the weights again for AdamW) never takes room on a GPU.
    """
    path = require_checkpoint_file(path, "--ckpt")
    if is_checkpoint_dir(path):  # the weights gathered whole from every rank's files, the optimizer state left unread
        entries = read_whole(path, optimizer=False)
        buffer = io.BytesIO()
        torch.save(entries, buffer)
        buffer.seek(0)
        source: Path | io.BytesIO = buffer
    else:
        entries = torch.load(path, map_location="cpu", mmap=True, weights_only=False)  # no tensor read
        source = path
    tokenizer = _stored_tokenizer(path, entries)
    lit = LitLM.load_from_checkpoint(source, map_location="cpu", compile=False)
    return lit.model.to(device), tokenizer


def _stored_tokenizer(path: Path, entries: dict) -> Tokenizer:
    """The tokenizer a training checkpoint carries."""
    if not {"model_config", "tokenizer", LitLM.CHECKPOINT_HYPER_PARAMS_KEY} <= entries.keys():
        raise ValueError(f"{str(path)!r} was not written by lm_systems training (no model config or tokenizer)")
    return Tokenizer.from_str(entries["tokenizer"])


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and each option's default."""


def _number(kind: type, low: float, high: float = math.inf, low_open: bool = False) -> Callable[[str], float]:
    """An argparse type: ``kind(text)`` within [low, high] (low excluded when ``low_open``), else a one-line error."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'n integer' if kind is int else ' number'}") from None
        if value < low or (low_open and value == low) or value > high:
            interval = f"{'(' if low_open else '['}{low:g}, {high:g}]" if high < math.inf else f">= {low:g}"
            raise argparse.ArgumentTypeError(f"must be {'in ' if high < math.inf else ''}{interval}, got {text}")
        return value

    return parse


def _check_device(name: str) -> str:
    """Why ``name`` cannot be used here, or an empty string."""
    try:
        device = torch.device(name)
    except RuntimeError:
        return f"--device {name!r} is not a device (cpu, cuda, cuda:1, ...)"
    if device.type == "cuda" and not torch.cuda.is_available():
        return f"--device {name!r}: no CUDA device is available here; pass --device cpu"
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        return f"--device {name!r}: this machine has {torch.cuda.device_count()} CUDA devices (cuda:0 ...)"
    return ""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=_HelpFormatter)
    parser.add_argument(
        "--ckpt",
        required=True,
        default=argparse.SUPPRESS,
        help=f"checkpoint written by train.py, or {NEWEST!r}: the newest {RUN_CHECKPOINTS}",
    )
    parser.add_argument("--prompt", default="Once upon a time", help="text to continue (not empty)")
    parser.add_argument("--max_new_tokens", type=_number(int, 1), default=100, help="tokens to add at most")
    parser.add_argument("--temperature", type=_number(float, 0), default=0.8, help="0 means greedy")
    parser.add_argument("--top_p", type=_number(float, 0, 1, low_open=True), default=0.9, help="nucleus sampling mass")
    parser.add_argument("--num_samples", type=_number(int, 1), default=1, help="samples to print")
    parser.add_argument("--seed", type=int, default=0, help="seeds the sampling")
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where to run the model"
    )
    parser.add_argument("--debug", action="store_true", help=f"on an error, show the traceback (also {DEBUG_ENV}=1)")
    args = parser.parse_args(argv)
    if not args.prompt:
        parser.error("--prompt is empty: give some text to continue")
    if _check_device(args.device):
        parser.error(_check_device(args.device))
    if args.debug:
        request_debug()

    with reported_errors():
        try:
            ckpt = args.ckpt
            if ckpt == NEWEST and not Path(ckpt).exists():
                ckpt = newest_run_checkpoint()
                print(f"checkpoint: {ckpt}", file=sys.stderr)
            model, tokenizer = load_checkpoint(ckpt, device=args.device)
        except (ValueError, OSError) as error:  # the message names --ckpt; a traceback would bury it
            parser.error(str(error))
        generator = torch.Generator().manual_seed(args.seed)
        for i in range(args.num_samples):
            text = sample_text(
                model,
                tokenizer,
                args.prompt,
                max_new_tokens=args.max_new_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                generator=generator,
            )
            print(f"--- sample {i + 1} ---\n{text}")


if __name__ == "__main__":
    main()
