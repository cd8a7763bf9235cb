"""naive_ddp, overlap_ddp, bucketed_ddp and zero1 on two CPU processes (gloo) against single-process training
on the same global batch: accumulation, clipping, LR schedule, validation, teardown, zero1's sharded state
and its checkpoint resume.

The processes are started once with torch.multiprocessing and join Lightning as externally launched ones
(the torchrun / SLURM path), so one start-up serves every strategy; one run goes through Lightning's own
spawn launcher (``bucketed_ddp_spawn``)."""

from __future__ import annotations

import pytest
import torch
from strategy_workers import (
    ACCUMULATE,
    EPOCHS,
    STEPS_PER_EPOCH,
    TinyData,
    TinyLM,
    load_ranks,
    make_trainer,
    run_cpu_strategies,
    single_process_reference,
    zero1_epoch0_checkpoint,
)

import strategies  # noqa: F401  (registers the strategy names)
from lm_systems.files.checkpoint_io import read_checkpoint
from lm_systems.parallel.bucketed import ACROSS_HOSTS_BUCKET_MB, ONE_HOST_BUCKET_MB

STRATEGIES = ["naive_ddp", "overlap_ddp", "bucketed_ddp", "zero1", "bucketed_ddp+no_thread"]
WRAPPERS = {
    "naive_ddp": "NaiveDDP",
    "overlap_ddp": "PerParameterDDP",
    "bucketed_ddp": "BucketedDDP",
    "zero1": "BucketedDDP",
    "bucketed_ddp+no_thread": "BucketedDDP",
}
# zero1 reduces each gradient only to the rank that steps it: its hooks see that rank's gradients, whose norms
# combine into one process's (tests/strategy_tests/test_zero1_clipping.py); with grad_reduce all_reduce, all of them.
HOOKS_SEE_ALL_GRADIENTS = [name for name in STRATEGIES if name != "zero1"]


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("strategies")


@pytest.fixture(scope="module")
def reference(out_dir) -> dict:
    return single_process_reference(out_dir)


@pytest.fixture(scope="module")
def runs(out_dir, spawn_two_ranks) -> dict[str, list[dict]]:
    spawn_two_ranks(run_cpu_strategies, out_dir, STRATEGIES)
    return {name: load_ranks(out_dir, name) for name in [*STRATEGIES, "zero1_resumed"]}


def assert_state_close(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    # float32 throughout: two half-batch sums averaged vs one whole-batch sum differ by a few ulps (~1e-7)
    # per gradient element, grown over 4 AdamW steps; a wrong average moves weights by ~1e-2.
    for name in expected:
        torch.testing.assert_close(
            actual[name], expected[name], atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.slow
@pytest.mark.parametrize("name", STRATEGIES)
def test_trains_like_one_process_on_the_global_batch(runs, reference, name):
    """Ranks start from different weights (TinyLM.setup), accumulate 2 micro-batches, clip above the norms."""
    assert len(reference["grad_norms"]) == STEPS_PER_EPOCH * EPOCHS
    for rank in range(2):
        assert runs[name][rank]["wrapper"] == WRAPPERS[name]
        assert_state_close(runs[name][rank]["final"], reference["final"])


@pytest.mark.slow
@pytest.mark.parametrize("name", HOOKS_SEE_ALL_GRADIENTS)
def test_clipping_and_hooks_see_averaged_gradients_and_the_schedule(runs, reference, name):
    for rank in range(2):
        torch.testing.assert_close(runs[name][rank]["grad_norms"], reference["grad_norms"], rtol=1e-4, atol=1e-6)
        assert runs[name][rank]["lrs"] == pytest.approx(reference["lrs"])
    assert reference["lrs"] == pytest.approx([0.05 / (1 + s) for s in range(STEPS_PER_EPOCH * EPOCHS)])


@pytest.mark.slow
@pytest.mark.parametrize("name", STRATEGIES)
def test_accumulation_communicates_only_on_boundaries(runs, name):
    for rank in range(2):
        for batch_idx, calls in runs[name][rank]["collectives_per_batch"]:
            boundary = (batch_idx + 1) % ACCUMULATE == 0
            assert (calls > 0) == boundary, f"batch {batch_idx}: {calls} collectives"


@pytest.mark.slow
@pytest.mark.parametrize("name", STRATEGIES)
def test_validation_runs_through_the_wrapper(runs, reference, name):
    for rank in range(2):
        assert runs[name][rank]["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", STRATEGIES)
def test_teardown_removes_hooks_and_unwraps(runs, name):
    for rank in range(2):
        assert runs[name][rank]["unwrapped"]
        assert runs[name][rank]["hooks_left"] == 0
        assert runs[name][rank]["launch_threads_alive"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("name", STRATEGIES)
def test_backward_launching_strategies_use_a_launch_thread_unless_told_not_to(runs, name):
    for rank in range(2):
        assert runs[name][rank]["launch_thread"] == (name not in ("naive_ddp", "bucketed_ddp+no_thread"))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bucketed_ddp", "zero1"])
def test_gradients_are_bucketed_by_the_default_cap(runs, name):
    assert [result["bucket_size_mb"] for result in runs[name]] == [ONE_HOST_BUCKET_MB] * 2


@pytest.mark.parametrize("strategy", ["BucketedDDPStrategy", "Zero1Strategy"])
def test_a_given_bucket_cap_wins_else_the_hosts_choose(strategy):
    cls = getattr(strategies, strategy)
    given = cls(bucket_size_mb=5)
    given.num_nodes = 2
    assert given.bucket_size_mb == 5
    chosen = cls()
    assert chosen.bucket_size_mb == ONE_HOST_BUCKET_MB
    chosen.num_nodes = 2
    assert chosen.bucket_size_mb == ACROSS_HOSTS_BUCKET_MB


@pytest.mark.slow
def test_zero1_ranks_hold_state_only_for_their_shard(runs):
    owned = [set(runs["zero1"][r]["owned"]) for r in range(2)]
    assert owned[0] and owned[1] and owned[0].isdisjoint(owned[1])
    for rank in range(2):
        assert set(runs["zero1"][rank]["state_keys"]) == owned[rank]


@pytest.mark.slow
def test_zero1_resumes_from_its_consolidated_checkpoint(runs, out_dir):
    """Stopped after epoch 0 and resumed from its checkpoint: the uninterrupted run's trajectory."""
    saved = read_checkpoint(zero1_epoch0_checkpoint(out_dir))
    (optimizer_state,) = saved["optimizer_states"]
    assert len(optimizer_state["state"]) == 3, "one consolidated state for every trainable parameter"
    for rank in range(2):
        assert_state_close(runs["zero1_resumed"][rank]["final"], runs["zero1"][rank]["final"])
        assert runs["zero1_resumed"][rank]["lrs"] == pytest.approx(runs["zero1"][rank]["lrs"][STEPS_PER_EPOCH:])


@pytest.mark.slow
def test_spawn_variant_through_lightnings_launcher(out_dir, reference):
    trainer = make_trainer("bucketed_ddp_spawn", 2, str(out_dir), "bucketed_spawn", enable_checkpointing=False)
    trainer.fit(TinyLM(), datamodule=TinyData())
    for result in load_ranks(out_dir, "bucketed_spawn"):
        assert result["wrapper"] == "BucketedDDP"
        assert_state_close(result["final"], reference["final"])


@pytest.mark.parametrize(
    "strategy, options, said",
    [
        ("BucketedDDPStrategy", {"bucket_size_mb": 0}, "bucket_size_mb"),
        ("Zero1Strategy", {"bucket_size_mb": float("nan")}, "bucket_size_mb"),
        ("BucketedDDPStrategy", {"grad_comm_dtype": "int8"}, "grad_comm_dtype"),
        ("BucketedDDPStrategy", {"comm_max_ctas": 0}, "comm_max_ctas"),
        ("Zero1Strategy", {"exchange": "allgather"}, "init_args.exchange"),
        ("Zero1Strategy", {"exchange_stages": 0}, "init_args.exchange_stages"),
    ],
)
def test_bad_option_names_the_option(strategy, options, said):
    with pytest.raises(ValueError, match=said):
        getattr(strategies, strategy)(**options)
