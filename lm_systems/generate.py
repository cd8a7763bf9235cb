"""Sample text from a training checkpoint (the sampling itself is lm_systems.sampling's).

    python -m lm_systems.generate --ckpt logs/.../checkpoints/last.ckpt --prompt "Once upon a time"
"""

from __future__ import annotations

import argparse
import os
import zipfile
from pathlib import Path

import torch
from tokenizers import Tokenizer

from lm_systems.lit_module import LitLM
from lm_systems.model import TransformerLM
from lm_systems.sampling import sample_text


def require_checkpoint_file(path: str | Path, flag: str) -> Path:
    """``path`` as a Path if it holds a whole PyTorch checkpoint; otherwise an error naming ``flag``.

    Reads only the zip's central directory (at the file's end), so a truncated or foreign file is found
    without loading the checkpoint.
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{flag} {str(path)!r} is a folder, not a checkpoint file (pass e.g. {str(path / 'last.ckpt')!r})")
    if not path.exists():
        raise FileNotFoundError(f"{flag} {str(path)!r} does not exist")
    if not os.access(path, os.R_OK):
        raise PermissionError(f"{flag} {str(path)!r} cannot be read (permission denied)")
    try:
        with zipfile.ZipFile(path) as archive:
            complete = any(name.endswith("/data.pkl") or name == "data.pkl" for name in archive.namelist())
    except (zipfile.BadZipFile, OSError):
        complete = False
    if not complete:
        raise ValueError(f"{flag} {str(path)!r} is not a readable PyTorch checkpoint (truncated, or not written by torch.save)")
    return path


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> tuple[TransformerLM, Tokenizer]:
    """The model and tokenizer stored in a LitLM checkpoint, the model on ``device``, with an error naming --ckpt
    if it can't be read.

    The model is rebuilt by ``LitLM.load_from_checkpoint`` from the checkpoint's hyperparameters (the vocabulary
    resolved at training time included), uncompiled: each new length of a growing sample would recompile it.
    The checkpoint is read into host memory and only the weights move to ``device``: its optimizer state (twice
    the weights again for AdamW) never takes room on a GPU.
    """
    path = require_checkpoint_file(path, "--ckpt")
    tokenizer = _stored_tokenizer(path)
    lit = LitLM.load_from_checkpoint(path, map_location="cpu", compile=False)
    return lit.model.to(device), tokenizer


def _stored_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer a training checkpoint carries; memory-mapped, so no tensor of the checkpoint is read."""
    entries = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    if not {"model_config", "tokenizer", LitLM.CHECKPOINT_HYPER_PARAMS_KEY} <= entries.keys():
        raise ValueError(f"{str(path)!r} was not written by lm_systems training (no model config or tokenizer)")
    return Tokenizer.from_str(entries["tokenizer"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", required=True, help="checkpoint written by train.py")
    parser.add_argument("--prompt", default="Once upon a time", help="text to continue")
    parser.add_argument("--max_new_tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 means greedy")
    parser.add_argument("--top_p", type=float, default=0.9, help="nucleus sampling mass")
    parser.add_argument("--num_samples", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)

    try:
        model, tokenizer = load_checkpoint(args.ckpt, device=args.device)
    except (ValueError, OSError) as error:  # the message names --ckpt; a traceback would bury it
        parser.error(str(error))
    generator = torch.Generator().manual_seed(args.seed)
    for i in range(args.num_samples):
        text = sample_text(
            model, tokenizer, args.prompt, max_new_tokens=args.max_new_tokens,
            temperature=args.temperature, top_p=args.top_p, generator=generator,
        )
        print(f"--- sample {i + 1} ---\n{text}")


if __name__ == "__main__":
    main()
