"""16-mixed where each rank unscales only the gradients it holds (zero3's shards, zero1's owned gradients): the
GradScaler must agree on overflow across ranks, or the ranks would disagree on skipping a step."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from typing_extensions import override

from lm_systems.compat.torch import overflow_flags


def agree_on_overflow(plugin: Precision, device: torch.device, group: Optional[dist.ProcessGroup]) -> None:
    """Under a GradScaler, swap it for one that sums its overflow flags over ``group``'s ranks in ``unscale_``,
    carrying over the scale and its growth settings."""
    scaler = plugin.scaler if isinstance(plugin, MixedPrecision) else None
    if scaler is None or isinstance(scaler, ShardedGradScaler):
        return
    plugin.scaler = ScalarFlagShardedGradScaler(
        device=device.type,
        init_scale=scaler.get_scale(),
        growth_factor=scaler.get_growth_factor(),
        backoff_factor=scaler.get_backoff_factor(),
        growth_interval=scaler.get_growth_interval(),
        enabled=scaler.is_enabled(),
        process_group=group or dist.group.WORLD,
    )


class ScalarFlagShardedGradScaler(ShardedGradScaler):
    """torch's ShardedGradScaler with 0-dim overflow flags: fused AdamW takes the flag as ``found_inf`` and
    subtracts it from its 0-dim step counts, which fails on ShardedGradScaler's own shape-[1] flags."""

    @override
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)
        flags = overflow_flags(self, optimizer)
        for device, flag in flags.items():
            flags[device] = flag.reshape(())
