"""FlashAttention2Triton against a float64 reference.

Without CUDA the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1)
on tiny shapes with small unequal tiles (tuning.INTERPRETER_CONFIG); with CUDA the
same tests run the compiled kernels, and the `gpu` tests add long sequences, all three dtypes,
torch.compile, autocast and a short training run against SDPA.
"""

import sys

import pytest
import torch

if sys.platform != "linux":  # triton is a dependency on Linux only; there a broken install must fail
    pytest.skip("triton is installed on Linux only", allow_module_level=True)

from attention_reference import reference_attention, rel_error  # noqa: E402

from lm_systems.attention import flash_triton  # noqa: E402
from lm_systems.attention.flash_torch import FlashAttention2Torch  # noqa: E402
from lm_systems.attention.flash_triton import FlashAttention2Triton, flash_forward_triton  # noqa: E402
from lm_systems.attention.registry import attention_device_problem  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# ‖out − ref‖/‖ref‖ bounds; the reference is float64 on the same (already rounded) inputs, so only the
# kernel's own roundings count: P and dS cast to the input dtype for the tensor-core products, and the
# final cast of O, dQ, dK, dV.
BOUNDS = {
    # unit roundoff 2^-24; on GPU fp32 products run as three tf32 passes (≈ fp32). Sums over N keys.
    torch.float32: {"out": 2e-5, "grad": 5e-5},
    # u = 2^-11 ≈ 4.9e-4: rounding errors of random sign give ‖err‖/‖ref‖ ≈ u; 4u / 8u of margin.
    torch.float16: {"out": 2e-3, "grad": 4e-3},
    # u = 2^-8 ≈ 3.9e-3, same reasoning.
    torch.bfloat16: {"out": 1.6e-2, "grad": 3.2e-2},
}

# (leading dims, N_q, N_k, d): odd lengths, N_q != N_k both ways (with causal rows that see no key),
# d 16, 64 and 80 (padded to 128), 3-D inputs. Interpreter tiles are 32×16 and 16×32.
# About a second a case in the interpreter: the first shape alone is in the fast subset (pytest -m "not slow").
SMALL_SHAPES = [
    ((1, 2), 17, 17, 16),
    *(
        pytest.param(*shape, marks=pytest.mark.slow)
        for shape in [
            ((1, 2), 37, 48, 64),
            ((1, 2), 48, 17, 80),
            ((2,), 33, 33, 64),
            ((1, 1), 45, 20, 16),
        ]
    ),
]


def _inputs(lead, n_q, n_k, d, dtype, device=DEVICE):
    make = lambda n: torch.randn(*lead, n, d, dtype=dtype, device=device)  # noqa: E731
    return make(n_q), make(n_k), make(n_k)


def _grads(fn, q, k, v, grad_out):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    fn(q, k, v).backward(grad_out)
    return q.grad, k.grad, v.grad


def _check_against_reference(q, k, v, is_causal, fn=FlashAttention2Triton.apply):
    bound = BOUNDS[q.dtype]
    out = fn(q, k, v, is_causal)
    ref_out, _ = reference_attention(q, k, v, is_causal)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert rel_error(out, ref_out) < bound["out"]
    grad_out = torch.randn_like(out)
    got = _grads(lambda *a: fn(*a, is_causal), q, k, v, grad_out)
    want = _grads(lambda *a: reference_attention(*a, is_causal)[0], q, k, v, grad_out)
    for name, g, r in zip("qkv", got, want, strict=True):
        assert rel_error(g, r) < bound["grad"], name


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("lead,n_q,n_k,d", SMALL_SHAPES)
def test_matches_float64_reference(lead, n_q, n_k, d, dtype, is_causal):
    _check_against_reference(*_inputs(lead, n_q, n_k, d, dtype), is_causal)


@pytest.mark.slow
@pytest.mark.skipif(not flash_triton.interpreting(), reason="tile configs are chosen by autotuning on a GPU")
def test_tiles_taller_than_wide_and_wider_than_tall(monkeypatch):
    # The default interpreter tiles are 32×16 (forward, dQ) and 16×32 (dK/dV); GPU configs use both
    # aspect ratios in every kernel, so run the opposite ones too. d = 48 pads to 64; the autotune
    # caches are emptied so no earlier choice is reused.
    import triton

    from lm_systems.attention import tuning

    swapped = {"fwd": (16, 32), "dq": (16, 32), "dkdv": (32, 16)}
    for kind, (bm, bn) in swapped.items():
        monkeypatch.setitem(tuning.INTERPRETER_CONFIG, kind, triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}))
    for kernel in tuning.TUNED_FOR_EAGER.values():
        monkeypatch.setattr(kernel, "cache", {})
    for n_q, n_k in ((37, 50), (50, 19)):
        _check_against_reference(*_inputs((1, 2), n_q, n_k, 48, torch.float32), True)


def test_logsumexp_is_saved_and_matches_reference():
    q, k, v = (t.requires_grad_() for t in _inputs((1, 2), 40, 25, 16, torch.float32))
    out, lse = flash_forward_triton(q, k, v, True)
    _, ref_lse = reference_attention(q, k, v, True)
    assert lse.shape == q.shape[:-1] and lse.dtype == torch.float32
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))  # 15 rows see no key
    assert torch.allclose(lse[~torch.isinf(lse)].double(), ref_lse[~torch.isinf(ref_lse)], atol=1e-5)
    out = FlashAttention2Triton.apply(q, k, v, True)
    saved = out.grad_fn.saved_tensors
    assert [t.shape for t in saved] == [q.shape, k.shape, v.shape, q.shape, q.shape[:-1]]


def test_each_implementation_names_its_autograd_node():
    # What grad_fn, profiler traces and anomaly reports show: the two FlashAttention-2 Functions apart.
    q = torch.randn(1, 2, 9, 16, device=DEVICE, requires_grad=True)
    names = {type(cls.apply(q, q, q, False).grad_fn).__name__ for cls in (FlashAttention2Torch, FlashAttention2Triton)}
    assert names == {"_FlashAttention2TorchFunctionBackward", "_FlashAttention2TritonFunctionBackward"}


@pytest.mark.slow
def test_strided_inputs_as_the_model_passes_them():
    # q, k, v as views of one fused projection (B, T, 3, H, d) → (B, H, T, d) with row stride 3·H·d,
    # and a tensor whose last dim is strided (which the wrapper copies).
    qkv = torch.randn(2, 29, 3, 2, 32, device=DEVICE)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    _check_against_reference(q, k, v, True)
    _check_against_reference(q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v, True)


def test_autocast_casts_inputs_like_pytorch_attention():
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16  # interpreter: bf16 dots are unusable
    q, k, v = (t.requires_grad_() for t in _inputs((1, 2), 33, 33, 64, torch.float32))
    with torch.autocast(DEVICE, dtype=dtype):
        out = FlashAttention2Triton.apply(q, k, v, True)
    assert out.dtype == dtype
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32
    ref_out, _ = reference_attention(q.to(dtype), k.to(dtype), v.to(dtype), True)
    assert rel_error(out, ref_out) < BOUNDS[dtype]["out"]


@pytest.mark.parametrize(
    "make_bad,message",
    [
        (lambda q: (q[..., :8], q[..., :8], q[..., :8]), "head dims 16..128"),
        (lambda q: (torch.randn(1, 2, 9, 160), torch.randn(1, 2, 9, 160), torch.randn(1, 2, 9, 160)), "head dims"),
        (lambda q: (q.double(), q.double(), q.double()), "float16, bfloat16 and float32"),
        (lambda q: (q, q.half(), q.half()), "share a dtype"),
        (lambda q: (q, q[:, :1], q[:, :1]), "leading dims"),
    ],
)
def test_bad_inputs_raise_clear_errors(make_bad, message):
    q = torch.randn(1, 2, 9, 16, device=DEVICE)
    with pytest.raises(ValueError, match=message):
        FlashAttention2Triton.apply(*make_bad(q), False)


def test_cpu_tensors_outside_the_interpreter_are_refused(monkeypatch):
    monkeypatch.setattr(flash_triton, "interpreting", lambda: False)
    q = torch.randn(1, 2, 9, 16)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1") as refused:
        FlashAttention2Triton.apply(q, q, q, False)
    # The check at the door (before a run prepares anything) and the call's own check say the same.
    assert attention_device_problem("flash_triton", "cpu") in str(refused.value)
