"""NVTXRanges: leaves training unchanged, nests its ranges correctly, and switches library ranges on and off."""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch
from tiny_training import RandomTokenLM, fit

from callbacks import NVTXRanges


class RangeRecorder:
    """Stands in for torch.cuda.nvtx on a CPU machine: records pushes and pops, checks they balance."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.stack: list[str] = []

    def range_push(self, name: str) -> None:
        self.events.append(f"+{name}")
        self.stack.append(name)

    def range_pop(self) -> None:
        assert self.stack, "range_pop without an open range"
        self.events.append(f"-{self.stack.pop()}")


class ForcedNVTXRanges(NVTXRanges):
    """NVTXRanges as it behaves on a GPU run, so the CPU test sees its ranges."""

    @staticmethod
    def _device_has_nvtx(trainer: L.Trainer) -> bool:
        return True


@pytest.mark.slow
def test_training_is_unchanged(tmp_path):
    torch.manual_seed(3)
    plain = RandomTokenLM()
    torch.manual_seed(3)
    marked = RandomTokenLM()
    fit(plain, [], tmp_path / "plain", max_steps=4)
    fit(marked, [NVTXRanges(validation=True)], tmp_path / "marked", max_steps=4)
    assert len(plain.losses) == 4
    assert marked.losses == plain.losses
    for p, q in zip(plain.parameters(), marked.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.slow
def test_ranges_nest_per_phase_with_accumulation(tmp_path, monkeypatch):
    recorder = RangeRecorder()
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", recorder.range_push)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", recorder.range_pop)
    library_switch: list[bool] = []
    monkeypatch.setattr("callbacks.nvtx_ranges.set_nvtx_enabled", library_switch.append)
    callback = ForcedNVTXRanges(validation=True)
    fit(
        RandomTokenLM(),
        [callback],
        tmp_path,
        max_steps=2,
        accumulate_grad_batches=2,
        val_batches=1,
        val_check_interval=4,
    )

    micro_batch = ["+train_step", "+forward", "-forward", "+backward", "-backward"]
    stepping = [*micro_batch, "+optimizer_step", "-optimizer_step", "-train_step"]
    accumulating = [*micro_batch, "-train_step"]
    validation = ["+validation_step", "-validation_step"]
    assert recorder.events == [*accumulating, *stepping, *accumulating, *stepping, *validation]
    assert recorder.stack == []
    assert library_switch == [True, False]  # the library's own ranges are on for the fit only
