"""Lightning strategies over lm_systems.parallel; importing this package registers their names.

``naive_ddp``, ``overlap_ddp``, ``bucketed_ddp``, ``zero1`` and ``zero3`` (launched like Lightning's ``ddp``: the
script is re-run per process), each also as ``<name>_spawn`` (torch.multiprocessing spawn); and ``fsdp2``, torch's
own FSDP2 over the same blocks, the reference zero3 is measured against.
"""

from lightning.pytorch.strategies import StrategyRegistry

from strategies.data_parallel import BucketedDDPStrategy, ContainerDDPStrategy, NaiveDDPStrategy, OverlapDDPStrategy
from strategies.fsdp2 import FSDP2Strategy
from strategies.zero1 import Zero1Strategy
from strategies.zero3 import Zero3Strategy

_STRATEGIES = (NaiveDDPStrategy, OverlapDDPStrategy, BucketedDDPStrategy, Zero1Strategy, Zero3Strategy, FSDP2Strategy)
for _strategy in _STRATEGIES:
    _strategy.register_strategies(StrategyRegistry)

REGISTERED_NAMES: tuple[str, ...] = tuple(
    name for name, entry in StrategyRegistry.items() if entry["strategy"] in _STRATEGIES
)
"""The names this package registered, in registration order: what train.py tells the command line are ours."""

__all__ = [
    "REGISTERED_NAMES",
    "BucketedDDPStrategy",
    "ContainerDDPStrategy",
    "FSDP2Strategy",
    "NaiveDDPStrategy",
    "OverlapDDPStrategy",
    "Zero1Strategy",
    "Zero3Strategy",
]
