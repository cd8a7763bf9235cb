"""assign_buckets: every bucket within the cap (or one oversized parameter), listed in the order they fill up."""

import math

import pytest
import torch
import torch.nn as nn

from lm_systems.parallel.bucketed import MiB, assign_buckets


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
