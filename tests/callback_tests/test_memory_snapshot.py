"""MemorySnapshot: warns and carries on without CUDA; on a GPU writes a loadable snapshot and per-step peaks."""

from __future__ import annotations

import pickle

import pytest
import torch
from tiny_training import RandomTokenLM, fit

from callbacks import MemorySnapshot


@pytest.mark.slow
def test_cpu_run_warns_and_trains_on(tmp_path):
    module = RandomTokenLM()
    callback = MemorySnapshot(start_step=0)
    with pytest.warns(UserWarning, match="MemorySnapshot needs a CUDA device"):
        trainer = fit(module, [callback], tmp_path, max_steps=3)
    assert trainer.global_step == 3 and len(module.losses) == 3
    assert callback.snapshot_path is None and callback.peaks == []
    assert not list(tmp_path.rglob("*.pickle"))


@pytest.mark.parametrize(
    "kwargs, message",
    [({"start_step": -1}, "start_step"), ({"num_steps": 0}, "num_steps"), ({"mode": "backward"}, "mode")],
)
def test_bad_arguments_name_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MemorySnapshot(**kwargs)


def _cublas_workspace_bytes() -> int:
    """One cuBLAS workspace as torch sizes it by default (CUBLAS_WORKSPACE_CONFIG unset): 32 MiB on Hopper
    and later (:4096:8), 8 MiB + 128 KiB before (:4096:2:16:8)."""
    return 32 * 2**20 if torch.cuda.get_device_capability()[0] >= 9 else 8 * 2**20 + 128 * 2**10


def _fit_on_gpu(tmp_path, **kwargs) -> tuple[MemorySnapshot, dict]:
    callback = MemorySnapshot(**kwargs)
    fit(RandomTokenLM(), [callback], tmp_path, max_steps=4, accelerator="gpu")
    assert callback.snapshot_path is not None and callback.snapshot_path.is_file()
    with callback.snapshot_path.open("rb") as f:
        return callback, pickle.load(f)


@pytest.mark.gpu
def test_step_snapshot_is_written_and_loads(tmp_path):
    callback, snapshot = _fit_on_gpu(tmp_path, start_step=1, num_steps=2, mode="step")
    assert callback.snapshot_path.name == "memory_snapshot_rank0_step1-2.pickle"
    assert snapshot["segments"], "the snapshot holds no allocator segments"
    actions = {event["action"] for trace in snapshot["device_traces"] for event in trace}
    assert {"alloc", "free_completed"} <= actions
    assert [p["step"] for p in callback.peaks] == [0, 1, 2, 3]
    for peak in callback.peaks:
        assert 0 < peak["peak_forward_gib"] <= peak["peak_step_gib"]
    # Step 1's forward runs beside step 0's gradients (zeroed only after the forward) and AdamW's two
    # moments, none of which existed during step 0's forward: 3 × the parameter bytes, plus the
    # allocator's rounding of each tensor up to 512 bytes (and AdamW's step counters if on the GPU). And
    # one cuBLAS workspace: cuBLAS keys them by (handle, stream), backward multiplies on autograd's own
    # thread with its own handle, so step 0's backward leaves a workspace that step 0's forward did not
    # have (seen on an H100 and an H200, 2026-11-22: exactly 3 × parameter bytes + 32 MiB + 10 KiB, also
    # after warming cuBLAS on that thread first).
    params = list(RandomTokenLM().parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    growth = (callback.peaks[1]["peak_forward_gib"] - callback.peaks[0]["peak_forward_gib"]) * 1024**3
    rounding = growth - 3 * param_bytes - _cublas_workspace_bytes()
    assert 0 <= rounding <= 4 * 512 * len(params), f"growth {growth:.0f} B"


@pytest.mark.gpu
def test_forward_snapshot_stops_before_backward(tmp_path):
    forward, forward_snapshot = _fit_on_gpu(tmp_path / "forward", start_step=2, mode="forward")
    step, step_snapshot = _fit_on_gpu(tmp_path / "step", start_step=2, mode="step")
    assert forward.snapshot_path.name == "memory_snapshot_rank0_step2.pickle"
    assert 0 < _event_count(forward_snapshot) < _event_count(step_snapshot)


def _event_count(snapshot: dict) -> int:
    return sum(len(trace) for trace in snapshot["device_traces"])
