"""ShardedOptimizer (ZeRO-1) on two gloo ranks: trajectory, sharded state, consolidation, loading across world sizes."""

import pytest
import torch
from parallel_workers import SHARDED_RUNS, ToyNet, make_optimizer, run_sharded

from lm_systems.parallel import ShardedOptimizer
from lm_systems.parallel.stages import cut_into_stages

RUNS = [name for name, _, _ in SHARDED_RUNS]  # p2p / broadcast exchange; 1 (the default), 4 or 16 stages
STAGES = {name: stages for name, _, stages in SHARDED_RUNS}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, spawn_two_ranks):
    out = tmp_path_factory.mktemp("sharded")
    spawn_two_ranks(run_sharded, out)
    return [torch.load(out / f"sharded_rank{r}.pt") for r in range(2)]


def assert_state_close(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(
            actual[name], expected[name], atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.parametrize("run", RUNS)
def test_training_matches_single_process_adamw(runs, run):
    """Second parameter group added after construction, with its own learning rate."""
    for rank in range(2):
        assert_state_close(runs[rank][run]["final"], runs[0][run]["reference"])


@pytest.mark.parametrize("run", RUNS)
def test_each_rank_holds_state_only_for_its_balanced_shard(runs, run):
    owned = [set(runs[r][run]["owned"]) for r in range(2)]
    assert owned[0].isdisjoint(owned[1])
    trainable = {n for n, p in ToyNet().named_parameters() if p.requires_grad}
    assert owned[0] | owned[1] == trainable
    for rank in range(2):
        # never_used has no gradient, so AdamW creates no state for it.
        assert set(runs[rank][run]["state_keys"]) == owned[rank] - {"never_used.weight", "never_used.bias"}
    sizes = dict((n, p.numel()) for n, p in ToyNet().named_parameters())
    loads = [sum(sizes[n] for n in owned[r]) for r in range(2)]
    assert abs(loads[0] - loads[1]) <= max(sizes[n] for n in trainable), f"unbalanced shards: {loads}"


@pytest.mark.parametrize("run", ["p2p", "broadcast", "p2p_many_stages", "p2p_own_group", "broadcast_own_group"])
def test_exchange_starts_while_later_stages_are_still_to_step(runs, run):
    """The pipeline: the first stage's parameters are sent before the last stage is updated, on the
    process group the optimizer was given."""
    launch = "exchange@own" if run.endswith("own_group") else "exchange"
    for rank in range(2):
        events = runs[rank][run]["step_order"]
        assert set(events) == {"step", launch}, events
        assert events.count("step") == STAGES[run]
        last_step = len(events) - 1 - events[::-1].index("step")
        assert events.index(launch) < last_step, events


def test_one_stage_steps_the_whole_shard_then_exchanges(runs):
    for rank in range(2):
        assert runs[rank]["p2p_one_stage"]["step_order"] == ["step", "exchange"]


@pytest.mark.parametrize(
    ("sizes", "parts", "expected"),
    [
        ([5] * 8, 4, [0, 0, 1, 1, 2, 2, 3, 3]),
        ([100, 1, 1, 1], 4, [1, 3, 3, 3]),  # a parameter goes where its middle falls
        ([3, 3], 4, [1, 3]),  # more parts than parameters: some parts stay empty
        ([7], 1, [0]),
        ([], 4, []),
    ],
)
def test_cut_into_stages_of_about_equal_size(sizes, parts, expected):
    assert cut_into_stages(sizes, parts) == expected


def test_bad_exchange_stages_is_refused(single_rank_group):
    with pytest.raises(ValueError, match="exchange_stages"):
        ShardedOptimizer(ToyNet().parameters(), torch.optim.AdamW, exchange_stages=0)


def assert_optimizer_states_equal(actual: dict, expected: dict) -> None:
    assert [g["params"] for g in actual["param_groups"]] == [g["params"] for g in expected["param_groups"]]
    assert [g["lr"] for g in actual["param_groups"]] == [g["lr"] for g in expected["param_groups"]]
    assert actual["state"].keys() == expected["state"].keys()
    for index, state in expected["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(actual["state"][index][key], value, atol=1e-6, rtol=1e-4)


def test_consolidated_state_is_the_unsharded_optimizer_state(runs):
    assert_optimizer_states_equal(runs[0]["p2p"]["consolidated"], runs[0]["p2p"]["reference_optimizer"])
    assert "consolidated" not in runs[1]["p2p"], "only the rank named by `to` holds the consolidated state"


def test_loading_a_single_process_state_on_two_ranks_continues_its_trajectory(runs):
    for rank in range(2):
        assert_state_close(
            runs[rank]["resumed_from_single_process"]["final"], runs[0]["resumed_from_single_process"]["reference"]
        )


def test_consolidated_state_from_two_ranks_loads_on_one(runs, single_rank_group):
    model = ToyNet()
    model.load_state_dict(runs[0]["p2p"]["final"])
    optimizer = make_optimizer(model, "p2p")
    optimizer.load_state_dict(runs[0]["p2p"]["consolidated"])
    optimizer.consolidate_state_dict(to=0)
    assert_optimizer_states_equal(optimizer.state_dict(), runs[0]["p2p"]["reference_optimizer"])


def test_state_dict_without_consolidation_names_the_fix(single_rank_group):
    optimizer = make_optimizer(ToyNet(), "p2p")
    with pytest.raises(RuntimeError, match="consolidate_state_dict"):
        optimizer.state_dict()


def test_without_a_process_group_the_error_says_how_to_start_one():
    with pytest.raises(RuntimeError, match="init_process_group"):
        make_optimizer(ToyNet(), "p2p")


@pytest.mark.parametrize(
    "world_size, sizes",
    [(2, [600, 300, 300, 10, 10, 10, 10, 10, 10]), (3, [600, 400, 400, 200, 200])],
    ids=["two-ranks", "three-ranks"],
)
def test_shards_hold_equal_elements_where_the_sizes_allow(single_rank_group, monkeypatch, world_size, sizes):
    """Sizes that split into equal element counts (by hand: 630 + 630; 600 + 600 + 600) and whose largest-first
    sharing finds the split; sharing by parameter count would not (930 + 330; 800 + 600 + 400)."""
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: world_size)  # owners only: no step
    params = [torch.nn.Parameter(torch.zeros(size)) for size in sizes]
    optimizer = ShardedOptimizer(params, torch.optim.AdamW, lr=1e-3)
    loads = [sum(p.numel() for p in params if optimizer.owner(p) == rank) for rank in range(world_size)]
    assert loads == [sum(sizes) // world_size] * world_size
