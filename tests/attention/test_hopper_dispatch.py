"""When flash_triton takes the Hopper kernels (``hopper.dispatch``), what it leaves alone, and the ops compiled graphs
call. Runs anywhere: off Hopper (and on the CPU, through Triton's interpreter) the dispatch must change nothing, and
the TMA layout check, which costs a few Python operations a call, is asked only once the switch and the device allow.
"""

import math
import sys
from collections.abc import Callable

import pytest
import torch

if sys.platform != "linux":  # triton is a dependency on Linux only; there a broken install must fail
    pytest.skip("triton is installed on Linux only", allow_module_level=True)

from attention_reference import reference_attention, rel_error  # noqa: E402
from test_flash_triton import BOUNDS, _inputs  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from lm_systems.attention import flash_triton  # noqa: E402
from lm_systems.attention.flash_triton import FlashAttention2Triton  # noqa: E402
from lm_systems.attention.hopper import dispatch  # noqa: E402
from lm_systems.attention.hopper.dispatch import (  # noqa: E402
    BACKWARD_HEAD_DIMS,
    FORWARD_HEAD_DIMS,
    HOPPER_ENV,
    hopper_applies,
    hopper_backward_op,
    hopper_forward_op,
    strides_fit,
)


def _layout_check_that_records(asked: list) -> Callable[[], bool]:
    return lambda: asked.append(True) or True


@pytest.mark.parametrize("setting", [None, "0", "1"])
def test_the_layout_is_asked_only_where_the_kernels_could_run(setting, monkeypatch):
    if setting is None:
        monkeypatch.delenv(HOPPER_ENV, raising=False)
    else:
        monkeypatch.setenv(HOPPER_ENV, setting)
    asked = []
    q = torch.zeros(1, 1, 4, 128, dtype=torch.bfloat16)  # a CPU tensor: never sm_90
    assert hopper_applies((q,), _layout_check_that_records(asked), BACKWARD_HEAD_DIMS) is False
    assert asked == []


@pytest.mark.parametrize(
    "setting, dtype, head_dim, head_dims, taken",
    [
        (None, torch.bfloat16, 128, FORWARD_HEAD_DIMS, True),  # on by default
        (None, torch.bfloat16, 128, BACKWARD_HEAD_DIMS, True),
        ("1", torch.float16, 128, FORWARD_HEAD_DIMS, True),
        ("0", torch.bfloat16, 128, BACKWARD_HEAD_DIMS, False),
        (None, torch.bfloat16, 64, FORWARD_HEAD_DIMS, False),  # the portable forward is as fast at d 64
        (None, torch.bfloat16, 64, BACKWARD_HEAD_DIMS, True),
        (None, torch.float16, 96, BACKWARD_HEAD_DIMS, False),
        (None, torch.float32, 128, FORWARD_HEAD_DIMS, False),
    ],
)
def test_the_kernels_are_taken_on_sm90_at_their_head_dims_in_half_precision_unless_switched_off(
    setting, dtype, head_dim, head_dims, taken, monkeypatch
):
    if setting is None:
        monkeypatch.delenv(HOPPER_ENV, raising=False)
    else:
        monkeypatch.setenv(HOPPER_ENV, setting)
    monkeypatch.setattr(dispatch, "_is_sm90", lambda device: True)
    q = torch.zeros(1, 1, 4, head_dim, dtype=dtype, device="meta")
    monkeypatch.setattr(type(q), "is_cuda", property(lambda self: True))
    asked = []
    assert hopper_applies((q,), _layout_check_that_records(asked), head_dims) is taken
    assert asked == ([True] if taken else [])


def test_another_value_of_the_switch_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv(HOPPER_ENV, "yes")
    with pytest.raises(ValueError, match=f"{HOPPER_ENV} must be 1 .* or 0"):
        hopper_applies((torch.zeros(1, 1, 4, 128),), lambda: True, FORWARD_HEAD_DIMS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path: the GPU tests cover sm_90")
def test_the_cpu_forward_and_backward_stay_portable_with_the_switch_on(monkeypatch):
    monkeypatch.setenv(HOPPER_ENV, "1")
    q, k, v = (t.requires_grad_() for t in _inputs((1, 2), 40, 56, 16, torch.float32))
    out = FlashAttention2Triton.apply(q, k, v, True)
    assert rel_error(out, reference_attention(q, k, v, True)[0]) < BOUNDS[torch.float32]["out"]
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_views_whose_strides_the_shipped_ptx_was_not_specialised_for_stay_on_the_portable_kernels(monkeypatch):
    """Rows 136 elements apart are 16-byte aligned (TMA takes them) but not a multiple of 16 elements (the PTX's
    specialisation): such a call falls back to the portable kernels, before the layout check, instead of failing."""
    monkeypatch.delenv(HOPPER_ENV, raising=False)
    monkeypatch.setattr(dispatch, "_is_sm90", lambda device: True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    whole = torch.zeros(2, 3, 80, 128, dtype=torch.bfloat16, device="meta")
    padded = torch.zeros(1, 2, 65, 136, dtype=torch.bfloat16, device="meta")[..., :128]
    assert strides_fit((whole, whole.transpose(1, 2))) and not strides_fit((whole, padded))
    asked = []
    for views, taken in [((whole, whole.transpose(1, 2)), True), ((padded, whole), False), ((whole, padded), False)]:
        assert hopper_applies(views, _layout_check_that_records(asked), BACKWARD_HEAD_DIMS) is taken
    assert asked == [True]


def test_a_direct_call_of_the_backward_on_such_strides_is_refused_before_a_launch():
    whole = torch.zeros(1, 2, 65, 128, dtype=torch.bfloat16)
    padded = torch.zeros(1, 2, 65, 136, dtype=torch.bfloat16)[..., :128]
    lse = delta = torch.zeros(1, 2, 65)
    with pytest.raises(ValueError, match="multiples of 16 elements, got .*136"):
        dispatch.hopper_backward(whole, whole, whole, padded, lse, delta, whole, whole, whole, True)


def test_the_ops_give_outputs_shaped_as_flash_triton_s_under_fake_tensors():
    """What compiled graphs see of the ops (fakes: nothing launched): O as q, L float32 of ``q.shape[:-1]``, and dQ,
    dK, dV as q, k, v."""
    with FakeTensorMode():
        q, grad_out = (torch.empty(2, 4, 70, 128, dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.empty(2, 4, 90, 128, dtype=torch.bfloat16) for _ in range(2))
        out, lse = hopper_forward_op(q, k, v, True)
        grads = hopper_backward_op(q, k, v, grad_out, lse, torch.empty(2, 4, 70), True)
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == (q.shape, q.dtype, (2, 4, 70), torch.float32)
    assert [(g.shape, g.dtype) for g in grads] == [(t.shape, t.dtype) for t in (q, k, v)]


def test_flash_triton_hands_its_forward_and_backward_to_the_hopper_kernels_where_they_apply(monkeypatch):
    """The wiring, on any machine: where ``hopper_applies`` says yes, FlashAttention2Triton's eager forward fills its
    output through ``hopper_forward`` and its backward returns what the backward's op returns."""
    calls = []

    def forward(q4, k4, v4, out4, lse, is_causal):
        calls.append(("forward", is_causal))
        out4.fill_(2.0)
        lse.zero_()

    def backward_op(q, k, v, grad_out, lse, delta, is_causal):
        calls.append(("backward", is_causal))
        return tuple(torch.full_like(t, 3.0) for t in (q, k, v))

    monkeypatch.setattr(flash_triton, "hopper_applies", lambda views, tma_layout_ok, head_dims: True)
    monkeypatch.setattr(flash_triton, "hopper_forward", forward)
    monkeypatch.setattr(flash_triton, "hopper_backward_op", backward_op)
    q, k, v = (t.requires_grad_() for t in _inputs((1, 2), 40, 56, 16, torch.float32))
    out = FlashAttention2Triton.apply(q, k, v, True)
    out.sum().backward()
    assert calls == [("forward", True), ("backward", True)]
    assert torch.all(out == 2.0) and all(torch.all(t.grad == 3.0) for t in (q, k, v))


def test_the_row_statistics_are_the_logsumexp_in_log2_units_then_d_in_rows_tma_can_copy():
    from lm_systems.attention.hopper.dispatch import row_statistics

    lse, delta = torch.randn(2, 3, 5), torch.randn(2, 3, 5)
    stats = row_statistics(lse, delta, heads=6, n_q=5, n_q_padded=8)
    assert stats.shape == (6, 2, 8) and stats.stride(1) * stats.element_size() % 16 == 0
    torch.testing.assert_close(stats[:, 0, :5], lse.reshape(6, 5) / math.log(2))
    torch.testing.assert_close(stats[:, 1, :5], delta.reshape(6, 5))


def test_torch_compile_asks_whether_the_device_is_hopper_once_while_tracing_and_keeps_the_answer(monkeypatch):
    """``auto`` asks ``hopper_applies`` inside the model's compiled graph: its device, switch and stride checks must
    trace without breaking the graph (the GPU suite runs the whole of it there)."""
    from lm_systems.attention.hopper.dispatch import hopper_setting, is_hopper, strides_fit

    asked = []
    monkeypatch.setattr(dispatch, "_is_sm90", lambda device: asked.append(device) or True)
    monkeypatch.delenv(HOPPER_ENV, raising=False)
    torch.compiler.reset()

    def attend(x):
        return x + 1 if hopper_setting() == "1" and strides_fit((x,)) and is_hopper(x.device) else x - 1

    compiled = torch.compile(attend, fullgraph=True, backend="eager")
    x = torch.zeros(1, 2, 16, 16)
    assert torch.equal(compiled(x), x + 1) and torch.equal(compiled(x), x + 1)
    assert asked == [x.device]  # at trace time only: the graph keeps the answer
