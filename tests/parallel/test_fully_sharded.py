"""FullyShardedDataParallel (ZeRO-3) on two gloo ranks against single-process training on the global batch."""

import pytest
import torch
from fully_sharded_workers import (
    CLIP,
    COMPUTE_DTYPES,
    UNITS,
    ShardToy,
    global_batches,
    loss_of,
    make_optimizer,
    run_fully_sharded,
)

from lm_systems.parallel import FullyShardedDataParallel

# fp32: the same arithmetic as one process up to summation order (measured 1.2e-7). bf16 / fp16: each rank's
# gradient of half the batch is rounded to the compute dtype and the two summed in it, where one process
# rounds the whole batch's once: after 3 steps at lr 0.05 the weights differ by 1.1e-4 (bf16) and 2.1e-5
# (fp16), half of what computing in float32 instead moves them (2.7e-4, 4.5e-5: see the next test).
TOLERANCE = {"fp32": 1e-5, "bf16": 1.6e-4, "fp16": 3.2e-5}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, spawn_two_ranks):
    out = tmp_path_factory.mktemp("fully_sharded")
    spawn_two_ranks(run_fully_sharded, out)
    return [torch.load(out / f"fully_sharded_rank{r}.pt") for r in range(2)]


def assert_params_close(actual: dict, expected: dict, atol: float) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(
            actual[name].detach(), expected[name].detach(), atol=atol, rtol=0, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.parametrize("dtype", COMPUTE_DTYPES)
def test_gathered_parameters_match_one_process_on_the_global_batch(runs, dtype):
    """Inputs differ per rank; 2 micro-batches accumulated (the first under no_sync); clipped every step."""
    reference = runs[0][dtype]["reference"]
    for rank in range(2):
        assert_params_close(runs[rank][dtype]["final"], reference, TOLERANCE[dtype])
    assert not torch.equal(reference["hidden.weight"], runs[0][dtype]["initial"]["hidden.weight"]), "it trained"
    assert torch.equal(runs[0][dtype]["final"]["frozen.weight"], runs[0][dtype]["initial"]["frozen.weight"])
    assert torch.equal(runs[0][dtype]["final"]["never_used.weight"], runs[0][dtype]["initial"]["never_used.weight"])


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_the_tolerance_tells_the_compute_dtype_from_float32(runs, dtype):
    """Training in float32 would miss the low-precision reference by more than its tolerance."""
    fp32, reference = runs[0]["fp32"]["final"], runs[0][dtype]["reference"]
    largest = max((fp32[name] - reference[name]).abs().max().item() for name in reference)
    assert largest > TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", COMPUTE_DTYPES)
def test_clip_grad_norm_returns_the_global_norm(runs, dtype):
    for rank in range(2):
        torch.testing.assert_close(
            torch.stack(runs[rank][dtype]["norms"]),
            torch.stack(runs[0][dtype]["reference_norms"]),
            rtol=1e-5 if dtype == "fp32" else 1e-2,
            atol=0,
        )
    assert min(runs[0][dtype]["reference_norms"]) > CLIP, "every step clips"


def test_each_rank_holds_its_rows_and_parameters_outside_units_whole(runs):
    shapes = runs[0]["fp32"]["shard_shapes"]
    assert shapes["embed.weight"] == (19, 13)  # 37 rows: 19 per rank, one padding row on rank 1
    assert shapes["hidden.bias"] == (7,)
    assert shapes["never_used.bias"] == (2,)  # 3 rows
    assert shapes["frozen.weight"] == (7, 13)  # frozen parameters are sharded too
    for replicated in ("gain", "block.gain", "tied_a.weight"):
        assert shapes[replicated] == tuple(ShardToy().get_parameter(replicated).shape)


def test_gradients_are_left_none_where_one_process_leaves_them(runs):
    for rank in range(2):
        grad_is_none = runs[rank]["fp32"]["grad_is_none"]
        assert grad_is_none["never_used.weight"] and grad_is_none["never_used.bias"] and grad_is_none["frozen.weight"]
        assert not grad_is_none["hidden.weight"] and not grad_is_none["gain"] and not grad_is_none["tied_a.weight"]


def test_no_sync_communicates_no_gradients_and_the_sync_reduce_scatters_during_backward(runs):
    for rank in range(2):
        for no_sync, sync in runs[rank]["fp32"]["logs"]:
            assert "reduce_scatter" not in no_sync and "all_gather" in no_sync
            # Five units that run hold trainable parameters: one reduce-scatter each, the first ones launched
            # while earlier units are still being gathered for their backward.
            assert sync.count("reduce_scatter") == 5
            backward = sync[sync.index("forward head") :]
            assert backward.index("reduce_scatter") < len(backward) - 1 - backward[::-1].index("all_gather")


def test_a_reduce_scatter_heavier_than_the_next_unit_is_finished_before_that_units_backward(runs):
    """Backward runs head, block.down, block.up: the head's gradients (518 values) outweigh block.down's (338), so
    its reduce-scatter is finished before block.down's backward and not held through it; block.down's stays in
    flight through block.up's backward (364 values) and is finished only once block.up's is launched."""
    for rank in range(2):
        _, sync = runs[rank]["fp32"]["logs"][1]
        backward = sync[sync.index("forward head") :]
        launches = [i for i, event in enumerate(backward) if event == "reduce_scatter"]
        head, down, up = launches[:3]
        assert "finish_reduce_scatter" in backward[head:down], backward
        assert "finish_reduce_scatter" not in backward[down:up], backward
        assert "finish_reduce_scatter" in backward[up : launches[3]], backward


def test_the_next_units_gather_is_launched_before_this_unit_computes(runs):
    """Second step onwards, forward: the all-gather of unit k+1 is under way before unit k's forward ends."""
    _, sync = runs[0]["fp32"]["logs"][1]
    forward = [e for e in sync if e.startswith("forward")]
    assert forward == [f"forward {u}" for u in ("embed", "hidden", "frozen", "block.up", "block.down", "head")]
    first_compute = sync.index("forward embed")
    assert sync[:first_compute].count("all_gather") == 2, sync


@pytest.mark.parametrize("depth", [0, 2, 9])
def test_prefetch_depth_moves_the_gathers_not_the_numbers(runs, depth):
    """``prefetch`` units ahead: before the first unit computes, its own all-gather and ``depth`` more (at most the
    five units after it); in backward, before the last unit's reduce-scatter, its own and ``depth`` more (the five
    before it). The arithmetic is the default's, bit for bit."""
    run = runs[0]["fp32_prefetch"][depth]
    _, sync = run["logs"][1]
    assert sync[: sync.index("forward embed")].count("all_gather") == 1 + min(depth, 5), sync
    backward = sync[sync.index("forward head") :]
    assert backward[: backward.index("reduce_scatter")].count("all_gather") == 1 + min(depth, 5), backward
    for name, value in runs[0]["fp32"]["final"].items():
        assert torch.equal(run["final"][name], value), name


def test_prefetch_must_not_be_negative(single_rank_group):
    with pytest.raises(ValueError, match="prefetch must be 0"):
        FullyShardedDataParallel(ShardToy(), prefetch=-1)


def test_teardown_leaves_full_parameters_and_no_hooks(runs):
    for rank in range(2):
        run = runs[rank]["fp32"]
        assert run["hooks_left"] == 0
        assert_params_close(run["unwrapped"], {n: v for n, v in run["final"].items() if n != "tied_b.weight"}, atol=0)


def test_full_state_dict_is_the_unsharded_modules(runs):
    state = runs[0]["fp32"]["full_state"]
    assert state.keys() == ShardToy().state_dict().keys()
    assert_params_close({k: v for k, v in state.items() if k != "scale"}, runs[0]["fp32"]["final"], atol=0)


def test_full_optimizer_state_is_the_single_process_adamws(runs):
    assert_optimizer_states_close(runs[0]["fp32"]["full_optimizer"], runs[0]["fp32"]["reference_optimizer"])
    assert_optimizer_states_close(runs[1]["fp32"]["full_optimizer"], runs[0]["fp32"]["reference_optimizer"])


def assert_optimizer_states_close(actual: dict, expected: dict) -> None:
    assert actual["param_groups"] == expected["param_groups"]
    assert actual["state"].keys() == expected["state"].keys()
    for index, values in expected["state"].items():
        assert actual["state"][index].keys() == values.keys()
        for key, value in values.items():
            torch.testing.assert_close(
                actual["state"][index][key],
                value,
                atol=1e-6,
                rtol=1e-4,
                msg=lambda m, index=index, key=key: f"param {index} {key}: {m}",
            )


def test_checkpoint_from_two_ranks_resumes_on_one(runs, single_rank_group):
    """World size 2's full weights and optimizer state loaded at world size 1: the same state, and one
    more step lands where the single-process reference's does."""
    run = runs[0]["fp32"]
    model = FullyShardedDataParallel(ShardToy())
    model.load_full_state_dict(run["full_state"])
    optimizer = make_optimizer(model.module.parameters())
    optimizer.load_state_dict(make_optimizer(ShardToy().parameters()).state_dict())  # fresh, then overwritten
    model.load_full_optimizer_state_dict(optimizer, run["full_optimizer"])
    assert_optimizer_states_close(model.full_optimizer_state_dict(optimizer), run["reference_optimizer"])

    reference = ShardToy()
    reference.load_state_dict(run["full_state"])
    reference_optimizer = make_optimizer(reference.parameters())
    reference_optimizer.load_state_dict(run["reference_optimizer"])
    tokens = global_batches()[0][0, 0]
    for net, opt, sharded in ((model, optimizer, True), (reference, reference_optimizer, False)):
        opt.zero_grad()
        loss_of(net(tokens[:, :-1]), tokens).backward()
        if sharded:
            net.finish_gradient_synchronization()
        opt.step()
    assert_params_close(model.gather_full_params(), dict(reference.named_parameters(remove_duplicate=False)), 1e-5)


def test_resident_parameter_and_gradient_bytes_are_a_shard(runs):
    """Between steps each rank holds its rows of every unit parameter (at most one padding row each) and the
    replicated norm weights, for parameters and gradients alike; no gathered copy stays allocated."""
    for rank in range(2):
        memory = runs[rank]["memory"]
        assert memory["gathered"] == 0
        shapes = memory["model_shapes"]
        replicated = shapes["final_norm.weight"][0][0] * 4
        sharded = {n: s for n, s in shapes.items() if n != "final_norm.weight"}
        total = sum(torch.Size(shape).numel() * size for shape, size in sharded.values())
        padding = sum(torch.Size(shape[1:]).numel() * size for shape, size in sharded.values())  # one row each
        assert memory["resident"] <= 2 * (total / 2 + padding + replicated)
        assert memory["resident"] >= 2 * (total / 2 + replicated)


def test_units_with_compiled_forwards_train_like_one_process(runs):
    """Each unit's forward compiled, the container's hooks outside it: the float32 numerics of one process."""
    reference = runs[0]["fp32"]["reference"]
    for rank in range(2):
        assert_params_close(runs[rank]["fp32_compiled"]["final"], reference, TOLERANCE["fp32"])
    assert runs[0]["fp32_compiled"]["logs"] == runs[0]["fp32"]["logs"], "the same gathers and reduce-scatters"


def test_a_unit_compiled_whole_is_refused_with_what_to_do(single_rank_group):
    model = ShardToy()
    model.hidden.compile()
    with pytest.raises(ValueError, match="compile its forward"):
        FullyShardedDataParallel(model)


def test_units_are_the_outermost_modules_of_the_given_types(single_rank_group):
    model = FullyShardedDataParallel(ShardToy(), unit_types=(torch.nn.Embedding, type(ShardToy().block)))
    assert [unit.prefix for unit in model._units] == ["embed", "block"]
    assert tuple(model.module.block.up.weight.shape) == (26, 13)  # world size 1: a shard is the whole
    assert sorted(UNITS) == sorted(u.prefix for u in FullyShardedDataParallel(ShardToy())._units)


def test_named_units_and_the_layers_of_the_unit_types_outside_them(single_rank_group):
    toy = ShardToy()
    model = FullyShardedDataParallel(toy, units=[toy.block])
    assert [unit.prefix for unit in model._units] == ["never_used", "embed", "hidden", "frozen", "block", "head"]


def test_optimizer_groups_see_the_shards_as_they_saw_the_parameters(single_rank_group):
    """Shards keep their names, modules and dims: LitLM's weight-decay grouping puts each where it was."""
    from lm_systems.model.config import ModelConfig
    from lm_systems.model.transformer import TransformerLM
    from lm_systems.training.optim import adamw_param_groups

    model = TransformerLM(ModelConfig.from_name("tiny", vocab_size=65, d_model=32, num_layers=2, num_heads=2, d_ff=48))
    names = {id(p): n for n, p in model.named_parameters()}
    before = [[names[id(p)] for p in group["params"]] for group in adamw_param_groups(model, 0.1)]
    wrapped = FullyShardedDataParallel(model, units=model.blocks)
    names = {id(p): n for n, p in wrapped.module.named_parameters()}
    assert [[names[id(p)] for p in group["params"]] for group in adamw_param_groups(wrapped.module, 0.1)] == before
    assert len(wrapped._units) == 2 + 2  # the blocks, the embedding and the LM head


class KeywordUnit(torch.nn.Module):
    """A unit called with a keyword tensor and a plain number, returning a dict: the hooks' general path."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.seen: list = []

    def forward(self, x: torch.Tensor, *, scale: float, mask: torch.Tensor) -> dict:
        self.seen.append((x.dtype, type(scale), mask.dtype))
        return {"out": self.linear(x) * scale * mask}


class KeywordToy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pre = torch.nn.Linear(4, 4)  # outside the unit: the unit's input needs a gradient
        self.unit = KeywordUnit()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = (torch.arange(4) % 2).float()
        return self.unit(self.pre(x), scale=2.0, mask=mask)["out"].square().sum()


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16])
def test_a_unit_called_with_keywords_casts_its_tensors_and_reduces_its_gradients(single_rank_group, compute_dtype):
    reference, wrapped = (
        KeywordToy(),
        FullyShardedDataParallel(KeywordToy(), compute_dtype=compute_dtype, unit_types=(KeywordUnit,)),
    )
    x = torch.randn(3, 4)
    reference(x).backward()
    wrapped(x).backward()
    wrapped.finish_gradient_synchronization()
    dtype = compute_dtype or torch.float32
    assert wrapped.module.unit.seen == [(dtype, float, dtype)]
    tolerance = 0 if compute_dtype is None else 0.05
    for name, param in reference.named_parameters():
        torch.testing.assert_close(
            wrapped.module.get_parameter(name).grad,
            param.grad,
            atol=tolerance,
            rtol=tolerance,
            msg=lambda m, name=name: f"{name}: {m}",
        )


def test_a_shard_whose_data_is_replaced_is_gathered_with_its_new_values(single_rank_group):
    """Gathers read each shard through a flat view made once; one whose ``.data`` was swapped (``module.to``
    with a new dtype or device, a user's assignment) must not be gathered from its old storage."""
    model = FullyShardedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 3)), unit_types=(torch.nn.Linear,))
    linear, x = model.module[0], torch.randn(2, 4)
    model(x)  # the views are made
    linear.weight.data = torch.full((3, 4), 0.5)
    torch.testing.assert_close(model(x), torch.nn.functional.linear(x, torch.full((3, 4), 0.5), linear.bias))


def test_a_replicating_container_offers_torchs_global_norm(single_rank_group):
    """Every container is a GlobalGradNorm; one whose ranks hold every gradient takes torch's norm over them."""
    from lm_systems.parallel import NaiveDDP
    from lm_systems.training.strategy_offers import GlobalGradNorm

    model = NaiveDDP(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)))
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 10
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert isinstance(model, GlobalGradNorm)
    torch.testing.assert_close(model.grad_norm(), expected)
    torch.testing.assert_close(model.clip_grad_norm_(1.0), expected)
    torch.testing.assert_close(model.grad_norm(), torch.tensor(1.0), atol=1e-5, rtol=0)


class Chain(torch.nn.Module):
    """Linear layers one after another: each a unit, its backward done before the one below it starts."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().sum()


@pytest.mark.parametrize("prefetch", [0, 1])
def test_a_unit_is_freed_as_soon_as_its_backward_is_done(single_rank_group, prefetch):
    """When a layer's backward starts, the layers above it, whose backward is done, hold no gathered memory: only
    this one and the ``prefetch`` below it do (held to the end of backward, every unit's would add up)."""
    model = FullyShardedDataParallel(Chain(4), prefetch=prefetch)
    layers = model.module.layers
    full_weights = {}  # each layer's weight as it computes with it: the gathered parameter

    def gathered() -> list[int]:
        return [index for index, weight in sorted(full_weights.items()) if weight.untyped_storage().nbytes()]

    held = []  # (layer, the layers holding gathered memory) as each layer's backward starts

    def on_backward_start(index: int):
        def hook(module, args, out) -> None:
            out.register_hook(lambda grad: held.append((index, gathered())))

        return hook

    for index, layer in enumerate(layers):  # hooks after the container's: they see what it has done
        layer.register_forward_pre_hook(
            lambda module, args, index=index: full_weights.__setitem__(index, module.weight)
        )
        layer.register_forward_hook(on_backward_start(index))
    loss = model(torch.randn(3, 16))
    assert len(full_weights) == len(layers) and gathered() == []  # each freed after its forward
    loss.backward()
    expected = [(index, list(range(max(0, index - prefetch), index + 1))) for index in reversed(range(len(layers)))]
    assert held == expected
    assert gathered() == []
