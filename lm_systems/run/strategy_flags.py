"""A strategy named on the command line together with its init arguments: ``--strategy bucketed_ddp
--trainer.strategy.bucket_size_mb 50``.

jsonargparse applies ``--trainer.strategy.KEY`` only to a strategy given as a class, so after a registered
name (or none: "auto") it refused the key with "Expected a dot import path string". The name is replaced by
its class and the init arguments it was registered with (``*_spawn``: ``start_method``), placed before the keys.
"""

from __future__ import annotations

from typing import Sequence

NAME_FLAGS = ("--strategy", "--trainer.strategy")
KEY_PREFIX = "--trainer.strategy."


def strategy_names_as_classes(args: Sequence[str]) -> list[str]:
    """``args`` with a registered strategy name spelled as its class where ``--trainer.strategy.*`` keys follow."""
    args = list(args)
    keys = [i for i, arg in enumerate(args) if arg.startswith(KEY_PREFIX)]
    if not keys:
        return args
    from lightning.pytorch.strategies import StrategyRegistry

    for index, arg in enumerate(args):
        flag, _, value = arg.partition("=")
        if flag not in NAME_FLAGS:
            continue
        width = 1 if value else 2
        value = value or (args[index + 1] if index + 1 < len(args) else "")
        if value not in StrategyRegistry:
            continue
        entry = dict.__getitem__(StrategyRegistry, value)
        strategy = entry["strategy"]
        spelled = ["--trainer.strategy", f"{strategy.__module__}.{strategy.__qualname__}"]
        for key, init_value in entry["init_params"].items():
            spelled += [f"{KEY_PREFIX}{key}", str(init_value)]
        del args[index : index + width]
        at = min(index, next(i for i, arg in enumerate(args) if arg.startswith(KEY_PREFIX)))
        return args[:at] + spelled + args[at:]
    return args
