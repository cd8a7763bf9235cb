"""Train a Transformer LM: `python train.py` (embedded tiny default), `python train.py -c configs/small.yaml`,
`python train.py --strategy bucketed_ddp --precision bf16-mixed --devices 2`. `--help` lists every option."""

import sys

from lm_systems.help_cache import run_with_help_cache


def main() -> None:
    from lm_systems.cli import main as train  # Lightning: imported only when the help is not already cached

    train()


if __name__ == "__main__":
    run_with_help_cache(sys.argv[1:], main)
