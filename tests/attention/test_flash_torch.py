"""FlashAttention2Torch against a float64 reference: output, logsumexp and all three gradients."""

from dataclasses import replace

import pytest
import torch
from attention_reference import reference_attention, rel_error

from lm_systems.attention import get_attention
from lm_systems.attention.flash_torch import FlashAttention2Torch, flash_forward_torch
from lm_systems.model.config import ModelConfig
from lm_systems.model.transformer import TransformerLM

# (leading dims, N_q, N_k, d): odd lengths, up to three 64-wide tiles, N_q < N_k and N_q > N_k, 2-D and 3-D inputs.
SHAPES = [
    ((1, 2), 17, 17, 16),
    ((2, 3), 45, 45, 64),
    ((1, 2), 150, 150, 80),
    ((2,), 33, 130, 24),
    ((1, 1), 130, 47, 32),
    ((), 70, 70, 16),
]


def _inputs(lead, n_q, n_k, d, dtype):
    make = lambda n: torch.randn(*lead, n, d, dtype=dtype, requires_grad=True)  # noqa: E731
    return make(n_q), make(n_k), make(n_k)


def _grads(fn, q, k, v, grad_out):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    fn(q, k, v).backward(grad_out)
    return q.grad, k.grad, v.grad


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("lead,n_q,n_k,d", SHAPES)
def test_matches_float64_reference(lead, n_q, n_k, d, is_causal):
    # float64 inputs: the tiled algorithm is exact up to rounding, so agreement is ~1e-15.
    q, k, v = _inputs(lead, n_q, n_k, d, torch.float64)
    out, lse = flash_forward_torch(q, k, v, is_causal)
    ref_out, ref_lse = reference_attention(q, k, v, is_causal)
    assert rel_error(out, ref_out) < 1e-12
    assert lse.shape == q.shape[:-1]
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    assert torch.allclose(lse[~torch.isinf(lse)], ref_lse[~torch.isinf(ref_lse)], atol=1e-12)

    grad_out = torch.randn_like(out)
    got = _grads(lambda *a: FlashAttention2Torch.apply(*a, is_causal), q, k, v, grad_out)
    want = _grads(lambda *a: reference_attention(*a, is_causal)[0], q, k, v, grad_out)
    for name, g, r in zip("qkv", got, want, strict=True):
        assert rel_error(g, r) < 1e-12, name


def test_rows_that_see_no_key_give_zero_output_and_gradient():
    # causal with N_q > N_k: the first N_q - N_k queries see nothing.
    q, k, v = _inputs((1, 2), 40, 25, 16, torch.float64)
    out = FlashAttention2Torch.apply(q, k, v, True)
    out.backward(torch.randn_like(out))
    assert torch.all(out[..., :15, :] == 0) and out[..., 15:, :].abs().sum() > 0
    assert torch.all(q.grad[..., :15, :] == 0) and torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()


@pytest.mark.parametrize(
    "dtype,bound",
    [
        # fp32 arithmetic, fp32 output: error ≈ a few ulps (1.2e-7) grown over ~N additions.
        (torch.float32, 1e-5),
        # bf16 output rounding alone is up to 2^-9 ≈ 2e-3 relative per element.
        (torch.bfloat16, 1e-2),
    ],
)
def test_low_precision_inputs_accumulate_in_fp32(dtype, bound):
    q, k, v = _inputs((1, 3), 77, 77, 64, dtype)
    out, lse = flash_forward_torch(q, k, v, True)
    ref_out, ref_lse = reference_attention(q, k, v, True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert rel_error(out, ref_out) < bound
    assert rel_error(lse, ref_lse) < 1e-6


def test_saves_only_logsumexp_beside_inputs_and_output():
    q, k, v = _inputs((2, 3), 37, 37, 16, torch.float32)
    out = FlashAttention2Torch.apply(q, k, v, True)
    saved = out.grad_fn.saved_tensors
    assert len(saved) == 5
    assert [t.shape for t in saved] == [q.shape, k.shape, v.shape, out.shape, q.shape[:-1]]


@pytest.mark.slow
def test_runs_under_torch_compile():
    # aot_eager traces forward and backward through dynamo and AOTAutograd without a C++ toolchain.
    q, k, v = _inputs((1, 2), 33, 33, 16, torch.float32)
    compiled = torch.compile(FlashAttention2Torch.apply, backend="aot_eager", fullgraph=True)
    assert rel_error(compiled(q, k, v, True), reference_attention(q, k, v, True)[0]) < 1e-5
    grad_out = torch.randn(1, 2, 33, 16)
    got = _grads(lambda *a: compiled(*a, True), q, k, v, grad_out)
    want = _grads(lambda *a: reference_attention(*a, True)[0], q, k, v, grad_out)
    # float32 as in test_low_precision_inputs_accumulate_in_fp32: a few ulps (1.2e-7) grown over the 33 keys.
    for name, g, r in zip("qkv", got, want, strict=True):
        assert rel_error(g, r) < 1e-5, name


@pytest.mark.parametrize(
    "make_bad,message",
    [
        (lambda q: (q, q.double(), q.double()), "share a dtype"),
        (lambda q: (q, q[..., :8], q[..., :8]), "head dim"),
        (lambda q: (q, q, q[:, :1]), "one shape"),
        (lambda q: (q, q.to("meta"), q.to("meta")), "one device"),
        (lambda q: (q[0, 0, 0], q[0, 0, 0], q[0, 0, 0]), r"\(\.\.\., N, d\)"),
        (lambda q: (q.long(), q.long(), q.long()), "floating-point"),
    ],
)
def test_bad_inputs_raise_clear_errors(make_bad, message):
    q = torch.randn(1, 2, 9, 16)
    with pytest.raises(ValueError, match=message):
        FlashAttention2Torch.apply(*make_bad(q), False)


@pytest.mark.slow
def test_model_with_flash_torch_matches_naive():
    config = ModelConfig(vocab_size=97, context_length=80, d_model=64, num_layers=2, num_heads=4, d_ff=128)
    torch.manual_seed(1)
    naive_model = TransformerLM(replace(config, attention="naive")).double()
    flash_model = TransformerLM(replace(config, attention="flash_torch")).double()
    flash_model.load_state_dict(naive_model.state_dict())
    tokens = torch.randint(0, 97, (2, 75))
    assert get_attention("flash_torch").__name__ == "flash_torch_attention"
    assert rel_error(flash_model(tokens), naive_model(tokens)) < 1e-12
