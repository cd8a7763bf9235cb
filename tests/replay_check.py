"""A recorded multi-process train.py run checked against its one-process replay (tests/run_record.py): the tests that
start ranks in other shapes (four processes, two simulated hosts) share it."""

from __future__ import annotations

from pathlib import Path

import torch
from run_record import load_records, replay

from lm_systems.files.checkpoint_io import read_checkpoint


def last_checkpoint(run_dir: Path) -> dict:
    (path,) = run_dir.rglob("last.ckpt")
    return read_checkpoint(path)


def assert_trained_like_replay(run_dir: Path, world_size: int, clip: float) -> None:
    """The run recorded in ``run_dir`` took ``world_size`` ranks' different batches; its last checkpoint holds the
    weights and AdamW moments of the replay on them, and every rank's replica ended equal to it bit for bit."""
    records = load_records(run_dir)
    assert [record["world_size"] for record in records] == [world_size] * world_size
    firsts = {tuple(record["batches"][0].flatten().tolist()) for record in records}
    assert len(firsts) == world_size, "every rank trained on batches of its own"
    reference = replay(records)
    assert min(reference["grad_norms"]) > clip, ("every step clips", reference["grad_norms"])
    saved = last_checkpoint(run_dir)
    assert saved["global_step"] == records[0]["max_steps"]
    for name, value in reference["state_dict"].items():
        assert not torch.equal(value, records[0]["initial"][name]), f"{name} never moved"
        # float32: the ranks' mean gradients averaged vs one mean over the global batch differ by a few ulps per
        # element, grown over the run's AdamW steps; clipping at one rank's norm moves weights by ~1e-3.
        torch.testing.assert_close(
            saved["state_dict"][name], value, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}"
        )
        for record in records:
            assert torch.equal(record["final"][name], saved["state_dict"][name]), name
    (optimizer_state,) = saved["optimizer_states"]
    for index, state in reference["optimizer"]["state"].items():
        for moment in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                optimizer_state["state"][index][moment],
                state[moment],
                rtol=1e-4,
                atol=1e-6 * state[moment].abs().max().item(),
                msg=lambda m, index=index, moment=moment: f"parameter {index}'s {moment}: {m}",
            )
