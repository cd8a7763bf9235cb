"""The seams between the strategies and LitLM: what each strategy offers (a global gradient norm, bucket runs) and what
LitLM offers a sharding strategy, checked as the typed protocols lm_systems looks for."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lm_systems.errors import InputError
from lm_systems.lit_module import LitLM
from lm_systems.training.clipping import clip_grad_norm, global_grad_norm
from lm_systems.training.compile_policy import compile_model
from lm_systems.training.strategy_offers import BlockRuns, GlobalGradNorm, LocalGradNorm, ShardingUnits
from strategies import (
    BucketedDDPStrategy,
    FSDP2Strategy,
    NaiveDDPStrategy,
    OverlapDDPStrategy,
    Zero1Strategy,
    Zero3Strategy,
)

CONTAINER_STRATEGIES = (NaiveDDPStrategy, OverlapDDPStrategy, BucketedDDPStrategy, Zero1Strategy, Zero3Strategy)


def tiny_lit() -> LitLM:
    return LitLM(size="tiny", vocab_size=64, d_model=16, num_layers=3, num_heads=2, d_ff=32, sample_prompt="")


def params_with_grads() -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]
    for p in params:
        p.grad = torch.randn_like(p) * 10
    return params


@pytest.mark.parametrize("strategy", CONTAINER_STRATEGIES, ids=lambda cls: cls.strategy_name)
def test_every_container_strategy_offers_a_global_gradient_norm(strategy):
    assert isinstance(strategy(), GlobalGradNorm)


def test_fsdp2_offers_none_and_torchs_norm_is_used_there():
    """FSDP2's DTensors carry their own global norm: torch's over the module's parameters is it."""
    trainer = SimpleNamespace(strategy=FSDP2Strategy())
    assert not isinstance(trainer.strategy, GlobalGradNorm)
    assert isinstance(global_grad_norm(trainer, torch.nn.Linear(2, 2)), LocalGradNorm)
    container = SimpleNamespace(strategy=Zero3Strategy())
    assert global_grad_norm(container, torch.nn.Linear(2, 2)) is container.strategy


@pytest.mark.parametrize(
    "strategy, offers",
    [
        (BucketedDDPStrategy, True),
        (Zero1Strategy, True),
        (NaiveDDPStrategy, False),
        (OverlapDDPStrategy, False),
        (Zero3Strategy, False),
    ],
    ids=lambda x: getattr(x, "strategy_name", x),
)
def test_bucket_runs_are_offered_by_the_bucketing_strategies(strategy, offers):
    assert isinstance(strategy(), BlockRuns) is offers


def test_compiling_by_buckets_needs_a_strategy_that_offers_bucket_runs():
    lit = tiny_lit()
    lit.configure_model()
    trainer = SimpleNamespace(world_size=2, strategy=NaiveDDPStrategy())
    with pytest.raises(InputError, match="--model.compile true") as error:
        compile_model(lit.model, "buckets", trainer, lit)
    # The registered names whose strategies offer the runs, found in the registry: lm_systems names none itself.
    offered = "bucketed_ddp or bucketed_ddp_spawn or zero1 or zero1_spawn"
    assert f"--strategy {offered})" in str(error.value)


def test_local_grad_norm_is_torchs():
    params = params_with_grads()
    expected = torch.nn.utils.get_total_norm([p.grad for p in params])
    norm = LocalGradNorm(params)
    torch.testing.assert_close(norm.grad_norm(), expected)
    torch.testing.assert_close(norm.clip_grad_norm_(1.0), expected)
    torch.testing.assert_close(
        torch.nn.utils.get_total_norm([p.grad for p in params]), torch.tensor(1.0), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clipping_in_the_step_leaves_the_gradients_and_returns_torchs_divisor(max_norm):
    """The divisor is torch's clip_grad_norm_ factor inverted: max(1, (norm + 1e-6) / max_norm)."""
    params = params_with_grads()
    before = [p.grad.clone() for p in params]
    norm, divisor = clip_grad_norm(LocalGradNorm(params), max_norm, in_step=True)
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before, strict=True))
    torch.testing.assert_close(divisor, torch.clamp((norm + 1e-6) / max_norm, min=1.0))
    assert clip_grad_norm(LocalGradNorm(params), max_norm, in_step=False)[1] is None


def test_litlm_offers_its_model_and_blocks_to_shard():
    lit = tiny_lit()
    lit.configure_model()
    assert isinstance(lit, ShardingUnits)
    root, units = lit.sharding_units()
    assert root is lit.model and list(units) == list(lit.model.blocks)


def test_fsdp2_refuses_a_module_that_names_no_units():
    with pytest.raises(TypeError, match="sharding_units"):
        FSDP2Strategy()._shard(torch.nn.Linear(2, 2), "32-true")
