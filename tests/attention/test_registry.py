"""The attention registry and the two reference implementations."""

import math
from types import SimpleNamespace

import pytest
import torch

from lm_systems.attention import describe_attention, get_attention, register_attention, registry, resolve_attention_name


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


def test_auto_is_sdpa_in_eager_and_the_registered_choice_inside_torch_compile(monkeypatch):
    half, full = torch.randn(1, 2, 8, 16, dtype=torch.float16), torch.randn(1, 2, 8, 16)
    monkeypatch.setattr(
        registry,
        "_AUTO_WHEN_COMPILED",
        [registry.AutoChoice("naive", lambda q: q.dtype == torch.float16, "fp16 queries")],
    )
    assert resolve_attention_name("auto") == resolve_attention_name("auto", half) == "sdpa"
    assert get_attention("auto", half) is get_attention("sdpa")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert resolve_attention_name("auto", half) == "naive"
    assert resolve_attention_name("auto", full) == "sdpa"  # the predicate declines: the default stays
    assert resolve_attention_name("auto") == "sdpa"  # no query to judge


def test_auto_takes_flash_triton_inside_torch_compile_up_to_2048_positions_and_from_16384_on_hopper(monkeypatch):
    from lm_systems.attention.flash_triton import _faster_when_compiled  # triton is a dependency on Linux
    from lm_systems.attention.hopper import dispatch
    from lm_systems.attention.hopper.dispatch import HOPPER_ENV

    monkeypatch.setattr(dispatch, "_is_sm90", {"cuda:0": True, "cuda:1": False}.get)  # an H200 and an A100
    monkeypatch.delenv(HOPPER_ENV, raising=False)

    def query(is_cuda=True, dtype=torch.bfloat16, head_dim=64, seq_len=512, device="cuda:0", row_stride=None):
        shape = (1, 25, seq_len, head_dim)
        strides = (25 * seq_len * head_dim, seq_len * head_dim, row_stride or head_dim, 1)
        return SimpleNamespace(is_cuda=is_cuda, dtype=dtype, shape=shape, device=device, stride=strides.__getitem__)

    assert ("flash_triton", _faster_when_compiled) in [choice[:2] for choice in registry._AUTO_WHEN_COMPILED]
    assert _faster_when_compiled(query()) and _faster_when_compiled(query(dtype=torch.float16))
    assert not _faster_when_compiled(query(dtype=torch.float32))  # its fp32 path is for correctness
    assert not _faster_when_compiled(query(is_cuda=False))
    assert not _faster_when_compiled(query(head_dim=256))
    assert _faster_when_compiled(query(seq_len=2048))  # measured faster than sdpa in the step at 512 and 2048
    assert not _faster_when_compiled(query(seq_len=8192))  # and slower at 8192 (the portable kernels)
    # At head dims 64 and 128 on Hopper its Gluon kernels run: measured at cuDNN's speed from 16,384 positions
    assert _faster_when_compiled(query(head_dim=128, seq_len=16384))
    assert _faster_when_compiled(query(head_dim=128, seq_len=32768, dtype=torch.float16))
    assert not _faster_when_compiled(query(head_dim=128, seq_len=8192))  # not measured between
    assert _faster_when_compiled(query(head_dim=64, seq_len=16384))  # the Gluon backward at d 64 too
    assert not _faster_when_compiled(query(head_dim=96, seq_len=32768))  # the portable kernels there
    assert not _faster_when_compiled(query(head_dim=128, seq_len=32768, device="cuda:1"))  # not Hopper
    assert not _faster_when_compiled(query(head_dim=128, seq_len=32768, row_stride=136))  # not the shipped PTX's
    monkeypatch.setenv(HOPPER_ENV, "0")
    assert not _faster_when_compiled(query(head_dim=128, seq_len=32768))  # the Hopper kernels switched off
    assert (
        "inside torch.compile flash_triton for fp16 / bf16 CUDA queries of at most 2048 positions, or of 16384 or more "
        "where its Hopper kernels take them, else sdpa" in describe_attention("auto", compiled=True)
    )
    assert describe_attention("auto", compiled=False) == "sdpa" and describe_attention("naive", True) == "naive"


def test_duplicates_are_refused():
    with pytest.raises(ValueError, match="already registered"):
        register_attention("naive")(lambda q, k, v, c: q)


def test_auto_dispatches_inside_a_compiled_graph_without_a_break(monkeypatch):
    """The choice is made while Dynamo traces (``is_compiling()`` is true there), in one graph."""
    traced = []
    naive = get_attention("naive")

    def counted_naive(*args):
        traced.append("naive")
        return naive(*args)

    monkeypatch.setitem(registry._REGISTRY, "naive", counted_naive)
    monkeypatch.setattr(
        registry,
        "_AUTO_WHEN_COMPILED",
        [registry.AutoChoice("naive", lambda q: q.dtype == torch.float32, "fp32 queries")],
    )
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    compiled = torch.compile(lambda q, k, v: get_attention("auto", q)(q, k, v, True), fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, k, v), naive(q, k, v, True))
    assert traced == ["naive"]  # traced once, into the graph
    assert get_attention("auto", q) is get_attention("sdpa")  # and sdpa outside it
