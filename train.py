"""Train a Transformer LM: `python train.py` (embedded tiny default), `python train.py -c configs/small.yaml`,
`python train.py --strategy bucketed_ddp --precision bf16-mixed --devices 2`. `--help` lists every option."""

from lm_systems.cli import main

if __name__ == "__main__":
    main()
