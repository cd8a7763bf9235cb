"""The attention registry and the two reference implementations."""

import math

import pytest
import torch

from lm_systems.attention import get_attention, register_attention, resolve_attention_name


def float64_attention(q, k, v, is_causal):
    """Loop-free but independent of naive.py: explicit index comparison for the end-aligned mask."""
    scores = torch.einsum("...id,...jd->...ij", q, k) / math.sqrt(q.shape[-1])
    if is_causal:
        n_q, n_k = q.shape[-2], k.shape[-2]
        i = torch.arange(n_q).view(-1, 1)
        j = torch.arange(n_k).view(1, -1)
        scores = torch.where(j <= i + (n_k - n_q), scores, torch.tensor(float("-inf"), dtype=scores.dtype))
    return torch.einsum("...ij,...jd->...id", scores.softmax(-1), v)


@pytest.mark.parametrize("name", ["naive", "sdpa"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("n_q, n_k", [(13, 13), (5, 21), (1, 9)])
def test_reference_implementations_match_float64(name, is_causal, n_q, n_k):
    q = torch.randn(2, 3, n_q, 24, dtype=torch.float64)
    k = torch.randn(2, 3, n_k, 24, dtype=torch.float64)
    v = torch.randn(2, 3, n_k, 24, dtype=torch.float64)
    out = get_attention(name)(q, k, v, is_causal)
    torch.testing.assert_close(out, float64_attention(q, k, v, is_causal), rtol=1e-10, atol=1e-10)


def test_auto_resolves_to_the_fastest_implementation_for_the_device():
    assert resolve_attention_name("auto", "cpu") == "sdpa"
    assert get_attention("auto", "cpu") is get_attention("sdpa")
    # sdpa on CUDA too: it trained the xl model faster than flash_triton at every context measured.
    assert resolve_attention_name("auto", "cuda") == "sdpa"


def test_unknown_name_lists_valid_ones_and_duplicates_are_refused():
    with pytest.raises(ValueError, match="--model.attention"):
        get_attention("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_attention("naive")(lambda q, k, v, c: q)
