"""A strategy named together with its init arguments: ``--strategy bucketed_ddp --trainer.strategy.bucket_size_mb 50``.

jsonargparse applies ``--trainer.strategy.KEY`` only to a strategy given as a class ("Expected a dot import path
string" after a registered name), so the name is spelled as its class and the init arguments it was registered with
(``*_spawn``: ``start_method``), before the keys.
"""

from __future__ import annotations

from typing import Sequence

KEY_PREFIX = "--trainer.strategy."


def strategy_names_as_classes(args: Sequence[str]) -> list[str]:
    """``args`` with a registered strategy name spelled as its class where ``--trainer.strategy.*`` keys follow."""
    args = list(args)
    if not any(arg.startswith(KEY_PREFIX) for arg in args):
        return args
    from lightning.pytorch.strategies import StrategyRegistry

    for index, arg in enumerate(args):
        flag, _, value = arg.partition("=")
        width = 1 if value else 2
        value = value or (args[index + 1] if index + 1 < len(args) else "")
        if flag not in ("--strategy", "--trainer.strategy") or value not in StrategyRegistry:
            continue
        entry = dict.__getitem__(StrategyRegistry, value)
        spelled = ["--trainer.strategy", f"{entry['strategy'].__module__}.{entry['strategy'].__qualname__}"]
        for key, init_value in entry["init_params"].items():
            spelled += [f"{KEY_PREFIX}{key}", str(init_value)]
        del args[index : index + width]
        at = min(index, next(i for i, arg in enumerate(args) if arg.startswith(KEY_PREFIX)))
        return args[:at] + spelled + args[at:]
    return args
