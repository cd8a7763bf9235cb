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

for _strategy in (NaiveDDPStrategy, OverlapDDPStrategy, BucketedDDPStrategy, Zero1Strategy, Zero3Strategy, FSDP2Strategy):
    _strategy.register_strategies(StrategyRegistry)

__all__ = ["BucketedDDPStrategy", "ContainerDDPStrategy", "FSDP2Strategy", "NaiveDDPStrategy", "OverlapDDPStrategy",
           "Zero1Strategy", "Zero3Strategy"]
