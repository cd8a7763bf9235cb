"""16-mixed where each rank unscales only the gradients it holds (zero1's owned gradients, zero3's shards): the
ranks agree on skipping a step when any rank's gradients overflow. Two CPU processes (gloo), each with a fused AdamW
over one parameter, an overflow in rank 1's gradient only."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision

from strategies.sharded_grad_scaler import ScalarFlagShardedGradScaler, agree_on_overflow

CPU = torch.device("cpu")


def _mixed_precision() -> MixedPrecision:
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7))


def test_a_grad_scaler_is_swapped_keeping_its_settings_and_bf16_is_left_alone():
    plugin = _mixed_precision()
    agree_on_overflow(plugin, CPU, group=None)
    assert isinstance(plugin.scaler, ScalarFlagShardedGradScaler)
    assert (plugin.scaler.get_scale(), plugin.scaler.get_growth_interval()) == (1024.0, 7)
    bf16 = MixedPrecision("bf16-mixed", "cpu")
    agree_on_overflow(bf16, CPU, group=None)
    assert bf16.scaler is None


def _one_step(plugin: MixedPrecision, overflow: bool) -> tuple[bool, float]:
    """Whether the parameter moved, and the scale after the step."""
    param = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.AdamW([param], lr=0.1, fused=True)
    slope = torch.full((4,), float("inf") if overflow else 1.0)
    plugin.scaler.scale((param * slope).sum()).backward()
    plugin.scaler.unscale_(optimizer)
    plugin.scaler.step(optimizer)
    plugin.scaler.update()
    return not torch.equal(param.detach(), torch.ones(4)), plugin.scaler.get_scale()


def _run(rank: int, world_size: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    try:
        overflow = rank == 1
        plain = _one_step(_mixed_precision(), overflow)
        agreeing = _mixed_precision()
        agree_on_overflow(agreeing, CPU, group=None)
        torch.save({"plain": plain, "agreeing": _one_step(agreeing, overflow)}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_ranks_agree_on_skipping_a_step_that_overflowed_on_one(tmp_path, spawn_two_ranks):
    spawn_two_ranks(_run, tmp_path)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]
    assert [r["plain"] for r in ranks] == [(True, 1024.0), (False, 512.0)], "a plain GradScaler: ranks disagree"
    assert [r["agreeing"] for r in ranks] == [(False, 512.0), (False, 512.0)]
