"""One checkpoint file from a checkpoint directory (as zero3, zero1 and fsdp2 write): the same contents a one-file
checkpoint holds, full tensors, readable by torch.load, by ``LitLM.load_from_checkpoint`` and by ``--ckpt_path``.

python -m lm_systems.files.consolidate logs/lm_systems/version_0/checkpoints/step=300.ckpt step300.ckpt
python -m lm_systems.files.consolidate DIR OUT.ckpt --weights_only true    # no optimizer state: a third the size
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lm_systems.errors import reported_errors
from lm_systems.files.checkpoint_dir import is_checkpoint_dir, read_whole
from lm_systems.files.checkpoint_io import SafeCheckpointIO


def consolidate(directory: str | Path, out: str | Path, optimizer: bool = True) -> Path:
    """Write ``directory``'s checkpoint to the file ``out`` (whole or not at all); ``out``."""
    checkpoint = read_whole(directory, optimizer=optimizer)
    if not optimizer:
        checkpoint.pop("lr_schedulers", None)  # a file without optimizer state resumes nothing but the weights
    SafeCheckpointIO().save_checkpoint(checkpoint, out)  # checks the room on disk first
    return Path(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", help="a checkpoint directory (holding .metadata and meta.pt)")
    parser.add_argument("out", help="the checkpoint file to write")
    parser.add_argument(
        "--weights_only",
        type=lambda text: text.lower() in ("true", "1", "yes"),
        default=False,
        help="leave the optimizer state out (default: false)",
    )
    args = parser.parse_args(argv)
    if not is_checkpoint_dir(args.directory):
        parser.error(f"{args.directory!r} is not a checkpoint directory (no .metadata and meta.pt in it)")
    if Path(args.out).is_dir():
        parser.error(f"{args.out!r} is a folder: name the file to write")
    with reported_errors():
        written = consolidate(args.directory, args.out, optimizer=not args.weights_only)
    print(f"wrote {written}")


if __name__ == "__main__":
    main()
