"""zero1 clipping every step, on two CPU processes (gloo) against single-process training on the same global batch:
each rank takes the norm of and scales only the gradients it steps, the ranks' squared norms summed. By default
(``grad_reduce: owner``) each gradient is also reduced only to the rank that steps it; with ``all_reduce`` to every
rank."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from strategy_workers import ENGAGED_CLIP, load_ranks, run_cpu_strategies, single_process_reference

import strategies
from strategies.zero1 import _owner_lookup

CLIP = ENGAGED_CLIP  # every step clips, by the norm over both ranks' gradients
RUNS = ["zero1", "zero1+all_reduce"]


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("zero1_clipping")


@pytest.fixture(scope="module")
def reference(out_dir) -> dict:
    return single_process_reference(out_dir, CLIP)


@pytest.fixture(scope="module")
def runs(out_dir, spawn_two_ranks) -> dict[str, list[dict]]:
    spawn_two_ranks(run_cpu_strategies, out_dir, RUNS, CLIP)
    return {name: load_ranks(out_dir, name) for name in RUNS}


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNS)
def test_trains_like_one_process_with_every_step_clipped(runs, reference, name):
    assert min(reference["grad_norms"]) > CLIP, "every step clips"
    for result in runs[name]:
        assert result["wrapper"] == "BucketedDDP"
        for name, expected in reference["final"].items():
            torch.testing.assert_close(
                result["final"][name], expected, atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}"
            )
        assert result["lrs"] == pytest.approx(reference["lrs"])
        assert result["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-5)


@pytest.mark.slow
def test_reducing_to_owners_leaves_each_rank_its_shard_of_the_averaged_gradients(runs, reference):
    """Before the step each rank's gradients are the mean over ranks of the parameters it owns, no others: the
    two ranks' norms combine into one process's norm, and neither alone reaches it."""
    for step, expected in enumerate(reference["grad_norms"]):
        local = [result["grad_norms"][step] for result in runs["zero1"]]
        assert math.hypot(*local) == pytest.approx(expected, rel=1e-4)
        assert max(local) < expected * (1 - 1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNS)
def test_teardown_removes_hooks_and_unwraps(runs, name):
    for result in runs[name]:
        assert result["unwrapped"] and result["hooks_left"] == 0 and result["launch_threads_alive"] == 0


def test_grad_reduce_takes_all_reduce_or_owner():
    with pytest.raises(ValueError, match="init_args.grad_reduce"):
        strategies.Zero1Strategy(grad_reduce="scatter")


def test_a_parameter_no_optimizer_holds_is_clipped_by_rank_0_and_reduced_to_nobody():
    held, loose = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
    optimizer = SimpleNamespace(param_groups=[{"params": [held]}], owner=lambda param: 1)
    clip_owner = _owner_lookup([optimizer], default=0)
    assert (clip_owner(held), clip_owner(loose)) == (1, 0)  # counted once in the norm over ranks
    with pytest.raises(ValueError, match="in none.*--trainer.strategy.grad_reduce all_reduce"):
        _owner_lookup([optimizer])(loose)
