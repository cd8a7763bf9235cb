"""flash_triton's Hopper kernels (``hopper``: the Gluon forward at head dim 128, the one-pass backward at 64 and 128)
against float64 attention, on an sm_90 GPU only.

Each case fills the outputs with NaN first, so a tile the kernels never write fails the bound. The kernels walk rings
of two slots over up to 256 tiles a program: a wrong mbarrier phase reads a stale slot (wrong values) or waits forever
(the CI stage's time limit); a slot handed back after one warpgroup's release instead of both is refilled under the
other (wrong values). A wrong causal split (diagonal tiles walked without the mask, or skipped) fails the causal and
rectangular cases. The backward adds dQ through TMA reductions from two shared-memory buffers: a buffer written again
before its reduction has read it, a tile's reduction sent to the wrong query rows or columns past N_q, an accumulator
not zeroed first, a dS tile rewritten before the other warpgroup's dQᵀ product has read it, or (d 64) a warpgroup's
half of the queries' dQᵀ stored in the other's columns, fails dQ. The forward's rows that see no key must come out
O = 0, L = -inf. Under Triton < 3.9 the backward runs the shipped PTX (``hopper.ptx``), so these cases test that too.
"""

import sys

import pytest
import torch

if sys.platform != "linux":  # triton is a dependency on Linux only; there a broken install must fail
    pytest.skip("triton is installed on Linux only", allow_module_level=True)

from attention_reference import reference_attention, rel_error  # noqa: E402
from test_flash_triton import BOUNDS, _grads, _inputs  # noqa: E402

from lm_systems.attention import flash_triton, resolve_attention_name  # noqa: E402
from lm_systems.attention.flash_triton import FlashAttention2Triton, _as_bhnd, flash_forward_triton  # noqa: E402
from lm_systems.attention.hopper import dispatch  # noqa: E402
from lm_systems.attention.hopper.dispatch import HOPPER_ENV, hopper_backward, hopper_forward  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
        reason="the Gluon kernels are written for compute capability 9.x (Hopper)",
    ),
]

# (leading dims, N_q, N_k, causal): ragged lengths, N_q != N_k both ways (N_q > N_k: rows that see no key),
# B·H = 150 above an H100's / H200's 132 SMs, one tile, long rings.
SHAPES = [
    ((2, 3), 1000, 1000, True),
    ((1, 2), 1531, 777, True),
    ((1, 4), 777, 1531, True),
    ((2, 2), 1024, 1024, False),
    ((1, 1), 200, 333, False),
    ((1, 1), 128, 128, True),
    ((3, 50), 257, 257, True),
    ((1, 2), 4096, 4096, True),
    ((1, 1), 16384, 16384, True),
]


@pytest.mark.parametrize("head_dim", [128, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lead,n_q,n_k,is_causal", SHAPES)
def test_backward_matches_float64_reference(lead, n_q, n_k, is_causal, dtype, head_dim):
    bound = BOUNDS[dtype]
    q, k, v = _inputs(lead, n_q, n_k, head_dim, dtype)
    out, lse = flash_forward_triton(q, k, v, is_causal)
    grad_out = torch.randn_like(out)
    q4, k4, v4, o4, do4 = (_as_bhnd(t) for t in (q, k, v, out, grad_out))
    delta = (o4.float() * do4.float()).sum(-1).contiguous()  # D = rowsum(dO ∘ O), (B, H, N_q)
    got = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    hopper_backward(q4, k4, v4, do4, lse, delta, *(_as_bhnd(g) for g in got), is_causal)
    want = _grads(lambda *a: reference_attention(*a, is_causal)[0], q, k, v, grad_out)
    for name, g, r in zip("qkv", got, want, strict=True):
        assert rel_error(g, r) < bound["grad"], name


# Beside SHAPES: keys far beyond the queries and the reverse (whole programs of rows that see no key), and B·H = 264,
# twice the SMs.
FORWARD_SHAPES = SHAPES + [((1, 1), 100, 5000, False), ((1, 1), 300, 2000, True), ((4, 66), 200, 200, True)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lead,n_q,n_k,is_causal", FORWARD_SHAPES)
def test_forward_matches_float64_reference(lead, n_q, n_k, is_causal, dtype):
    bound = BOUNDS[dtype]
    q, k, v = _inputs(lead, n_q, n_k, 128, dtype)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:-1], float("nan"), dtype=torch.float32, device=q.device)
    hopper_forward(_as_bhnd(q), _as_bhnd(k), _as_bhnd(v), _as_bhnd(out), lse, is_causal)
    ref_out, ref_lse = reference_attention(q, k, v, is_causal)
    assert rel_error(out, ref_out) < bound["out"]
    seen = torch.isfinite(ref_lse)  # rows that see no key: L = -inf on both sides, O = 0
    assert torch.equal(torch.isfinite(lse), seen) and rel_error(lse[seen], ref_lse[seen]) < bound["out"]
    assert torch.all(lse[~seen] == float("-inf")) and torch.all(out[~seen] == 0)


def _recording(taken: list, kernels):
    return lambda *args: taken.append(kernels.__name__) or kernels(*args)


@pytest.mark.parametrize("setting, head_dim", [(None, 128), ("0", 128), (None, 64)])
def test_flash_triton_takes_the_hopper_kernels_unless_switched_off(setting, head_dim, monkeypatch):
    """By default FlashAttention2Triton's eager forward and backward run the Gluon kernels at d 128 (still right, and
    the forward's L is what the backward reads), at d 64 the backward only; with ``LM_SYSTEMS_FLASH_HOPPER=0`` the
    portable kernels."""
    taken = []
    monkeypatch.setattr(flash_triton, "hopper_forward", _recording(taken, hopper_forward))
    monkeypatch.setattr(dispatch, "hopper_backward", _recording(taken, hopper_backward))
    if setting is None:
        monkeypatch.delenv(HOPPER_ENV, raising=False)
    else:
        monkeypatch.setenv(HOPPER_ENV, setting)
    q, k, v = (t.requires_grad_() for t in _inputs((1, 4), 777, 1531, head_dim, torch.bfloat16))
    out = FlashAttention2Triton.apply(q, k, v, True)
    assert rel_error(out, reference_attention(q, k, v, True)[0]) < BOUNDS[torch.bfloat16]["out"]
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    want = _grads(lambda *a: reference_attention(*a, True)[0], q, k, v, grad_out)
    for name, t, r in zip("qkv", (q, k, v), want, strict=True):
        assert rel_error(t.grad, r) < BOUNDS[torch.bfloat16]["grad"], name
    expected = {"0": [], None: ["hopper_forward", "hopper_backward"] if head_dim == 128 else ["hopper_backward"]}
    assert taken == expected[setting]


def test_the_hopper_kernels_run_inside_torch_compile(monkeypatch):
    """Under torch.compile flash_triton's forward and backward reach the Gluon kernels through their ops (Inductor
    launches plain Triton kernels only): right against float64, each taken once."""
    taken = []
    monkeypatch.setattr(dispatch, "hopper_forward", _recording(taken, hopper_forward))
    monkeypatch.setattr(dispatch, "hopper_backward", _recording(taken, hopper_backward))
    monkeypatch.delenv(HOPPER_ENV, raising=False)
    torch._dynamo.reset()
    compiled = torch.compile(FlashAttention2Triton.apply, fullgraph=True)
    q, k, v = (t.requires_grad_() for t in _inputs((2, 3), 1000, 1000, 128, torch.bfloat16))
    out = compiled(q, k, v, True)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    want = _grads(lambda *a: reference_attention(*a, True)[0], q, k, v, grad_out)
    for name, t, r in zip("qkv", (q, k, v), want, strict=True):
        assert rel_error(t.grad, r) < BOUNDS[torch.bfloat16]["grad"], name
    assert taken == ["hopper_forward", "hopper_backward"]


@pytest.mark.parametrize(
    "seq_len, head_dim, chosen", [(16384, 128, "flash_triton"), (16384, 64, "flash_triton"), (8192, 128, "sdpa")]
)
def test_auto_takes_the_hopper_kernels_inside_a_full_graph_at_long_context(seq_len, head_dim, chosen):
    """What the model asks while torch.compile traces it: the choice folds to a constant, no graph break."""
    q = torch.empty(1, 2, seq_len, head_dim, device="cuda", dtype=torch.bfloat16)
    choices = []

    def attend(q):
        choices.append(resolve_attention_name("auto", q))
        return q + 1

    torch.compile(attend, fullgraph=True)(q)
    assert choices == [chosen]
