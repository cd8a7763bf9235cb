"""SIGTERM to either rank of a two-process run (gloo, CPU): every rank stops at the batch after it, and the ranks
agree over the host: no broadcast on the default group while training (Lightning's agreement broadcasts there at
every batch and from its signal handler; with it, both of these runs hang)."""

from __future__ import annotations

import pytest
from sigterm_workers import MAX_STEPS, SIGNAL_AFTER, run_sigterm
from strategy_workers import load_ranks

STRATEGIES = ["bucketed_ddp", "zero3"]


@pytest.fixture(scope="module")
def results(tmp_path_factory, spawn_two_ranks) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("sigterm")
    spawn_two_ranks(run_sigterm, out_dir, STRATEGIES)
    return load_ranks(out_dir, "sigterm")


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("signalled", [0, 1])
def test_sigterm_to_one_rank_stops_every_rank_after_the_same_batch(results, strategy, signalled):
    for rank in range(2):
        result = results[rank][strategy, signalled]
        assert result["ended"] == "SIGTERM", (rank, result)
        assert result["batches"] == SIGNAL_AFTER and result["global_step"] == SIGNAL_AFTER < MAX_STEPS, (rank, result)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("signalled", [0, 1])
def test_no_rank_broadcasts_on_the_default_group_while_training(results, strategy, signalled):
    for rank in range(2):
        assert results[rank][strategy, signalled]["default_group_broadcasts"] == 0, rank
