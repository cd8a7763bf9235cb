"""Lightning strategies over lm_systems.parallel; importing this package registers their names.

``naive_ddp``, ``overlap_ddp``, ``bucketed_ddp`` and ``zero1`` (launched like Lightning's ``ddp``: the script
is re-run per process), each also as ``<name>_spawn`` (torch.multiprocessing spawn).
"""

from lightning.pytorch.strategies import StrategyRegistry

from strategies.data_parallel import BucketedDDPStrategy, ContainerDDPStrategy, NaiveDDPStrategy, OverlapDDPStrategy
from strategies.zero1 import Zero1Strategy

for _strategy in (NaiveDDPStrategy, OverlapDDPStrategy, BucketedDDPStrategy, Zero1Strategy):
    _strategy.register_strategies(StrategyRegistry)

__all__ = ["BucketedDDPStrategy", "ContainerDDPStrategy", "NaiveDDPStrategy", "OverlapDDPStrategy", "Zero1Strategy"]
