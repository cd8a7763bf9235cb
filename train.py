"""Train a Transformer LM: `python train.py` (embedded tiny default), `python train.py -c configs/small.yaml`,
`python train.py --strategy bucketed_ddp --precision bf16-mixed --devices 2`. `--help` lists every option.

Here the packages built on lm_systems (strategies/, callbacks/) are wired into its command line: lm_systems never
imports them."""

from __future__ import annotations

import sys
from typing import Any, Optional

from lm_systems.run.help_cache import run_with_help_cache


def main(args: Optional[list[str]] = None, run: bool = True) -> Any:
    """``lm_systems.cli.main`` with this project's strategies registered, its callbacks and its progress bar; the CUDA
    allocator's expandable segments unless PYTORCH_CUDA_ALLOC_CONF says otherwise (:mod:`lm_systems.run.allocator`)."""
    from lm_systems.run.allocator import use_expandable_segments

    use_expandable_segments()  # before anything touches CUDA; the ranks a launcher starts inherit it
    # Lightning: imported only when the help is not already cached.
    from callbacks import every_run_callbacks
    from callbacks.progress import steps_progress_bar
    from lm_systems.cli import main as train
    from strategies import REGISTERED_NAMES  # importing the package registers the names

    # Module-level functions only: a spawned launch pickles them with the trainer.
    return train(
        args, run=run, strategy_names=REGISTERED_NAMES, callbacks=every_run_callbacks, progress_bar=steps_progress_bar
    )


if __name__ == "__main__":
    run_with_help_cache(sys.argv[1:], main)
