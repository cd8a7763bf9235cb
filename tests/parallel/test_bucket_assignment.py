"""assign_buckets: every bucket within the cap (or one oversized parameter), listed in the order they fill up;
runs_within_buckets: runs of blocks whose gradients share one bucket."""

import math

import pytest
import torch
import torch.nn as nn

from lm_systems.parallel.bucketed import MiB, assign_buckets, gradient_buckets, runs_within_buckets


def params(*sizes_mb: float, dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    return [nn.Parameter(torch.empty(int(mb * MiB) // 4 or 1, dtype=dtype)) for mb in sizes_mb]


def nbytes(bucket: list[nn.Parameter]) -> int:
    return sum(p.numel() * p.element_size() for p in bucket)


def check_plan(order: list[nn.Parameter], buckets: list[list[nn.Parameter]], cap_mb: float) -> None:
    position = {id(p): i for i, p in enumerate(order)}
    flat = [p for b in buckets for p in b]
    assert sorted(position[id(p)] for p in flat) == list(range(len(order))), "each parameter exactly once"
    for bucket in buckets:
        assert len(bucket) == 1 or nbytes(bucket) <= cap_mb * MiB, "only a lone oversized parameter exceeds the cap"
        assert len({(p.device, p.dtype) for p in bucket}) == 1
        assert [position[id(p)] for p in bucket] == sorted(position[id(p)] for p in bucket)
    # Buckets launch in list order: each fills up (its last gradient arrives) after the ones before it.
    completions = [max(position[id(p)] for p in b) for b in buckets]
    assert completions == sorted(completions)


def test_small_parameters_share_a_bucket_across_oversized_ones():
    # Per layer, in backward order: three 39 MB matrices, a norm, a 10 MB matrix, a 29 MB one, a norm.
    layers = 6
    order = [p for _ in range(layers) for p in params(39, 39, 39, 0.01, 10, 29, 0.01)]
    buckets = assign_buckets(order, 25)
    check_plan(order, buckets, 25)
    # 4 lone matrices per layer; the norms and two layers' 10 MB matrices fill one bucket per two layers.
    assert len(buckets) == 4 * layers + layers // 2


@pytest.mark.parametrize("cap_mb", [0.5, 3, 25, 1000])
def test_any_cap_gives_a_valid_plan(cap_mb):
    g = torch.Generator().manual_seed(0)
    order = params(*(float(x) for x in torch.rand(40, generator=g) * 4))
    check_plan(order, assign_buckets(order, cap_mb), cap_mb)


def test_dtypes_never_share_a_bucket():
    order = params(1, 1) + params(1, dtype=torch.bfloat16) + params(1)
    buckets = assign_buckets(order, 25)
    check_plan(order, buckets, 25)
    assert [len(b) for b in buckets] == [2, 1, 1]


def test_a_cap_that_is_not_positive_is_refused():
    with pytest.raises(ValueError, match="bucket_size_mb"):
        assign_buckets(params(1), 0)


def test_one_bucket_takes_every_gradient_of_a_kind_once_backward_ends():
    order = params(0.1, 300, 2, 40, 0.5)
    buckets = assign_buckets(order, math.inf)
    assert [[id(p) for p in b] for b in buckets] == [[id(p) for p in order]]


class Block(nn.Module):
    def __init__(self, *sizes: int) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.empty(n)) for n in sizes)


def test_runs_within_buckets_join_blocks_of_one_bucket_and_leave_a_spanning_block_alone():
    b = [Block(4, 4) for _ in range(6)]
    buckets = [
        [*b[5].parameters(), *b[4].parameters()],
        [*b[3].parameters(), *b[2].parameters(), b[1].weights[1]],
        [b[1].weights[0], *b[0].parameters()],
    ]
    assert runs_within_buckets(b, buckets) == [1, 1, 2, 2]  # b0 | b1 spans two buckets | b2 b3 | b4 b5


def tiny_model(num_layers: int) -> nn.Module:
    from lm_systems.model.config import ModelConfig
    from lm_systems.model.transformer import TransformerLM

    return TransformerLM(ModelConfig.from_name("tiny", vocab_size=97, num_layers=num_layers))


@pytest.mark.parametrize("cap_mb, expected", [(math.inf, [4]), (1e-6, [1, 1, 1, 1])])
def test_one_bucket_is_one_run_and_a_bucket_a_parameter_a_run_a_block(cap_mb, expected):
    model = tiny_model(4)
    assert runs_within_buckets(model.blocks, gradient_buckets(model, cap_mb)) == expected


def test_runs_of_a_model_fit_its_buckets():
    model = tiny_model(4)
    block_mb = sum(p.numel() * 4 for p in model.blocks[0].parameters()) / MiB
    buckets = gradient_buckets(model, 2.5 * block_mb)
    runs = runs_within_buckets(model.blocks, buckets)
    assert sum(runs) == 4 and max(runs) >= 2  # a bucket holds two whole blocks somewhere
    bucket_of = {id(p): i for i, bucket in enumerate(buckets) for p in bucket}
    first = 0
    for size in runs:
        homes = {bucket_of[id(p)] for block in model.blocks[first : first + size] for p in block.parameters()}
        assert size == 1 or len(homes) == 1
        first += size
