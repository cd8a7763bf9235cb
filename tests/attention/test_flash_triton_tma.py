"""The backward passes' tensor-descriptor (TMA) loads: against the float64 reference and the pointer loads, and
where they are chosen.

On the CPU the interpreter runs the descriptor path when ``LM_SYSTEMS_FLASH_TMA=1`` forces it; on a GPU of
compute capability 9 or more it is the default, and the `gpu` tests of test_flash_triton_gpu.py run it.
"""

import sys

import pytest
import torch

if sys.platform != "linux":  # triton is a dependency on Linux only; there a broken install must fail
    pytest.skip("triton is installed on Linux only", allow_module_level=True)

from test_flash_triton import DEVICE, _check_against_reference, _grads, _inputs  # noqa: E402

from lm_systems.attention import flash_triton  # noqa: E402
from lm_systems.attention.flash_triton import TMA_ENV, FlashAttention2Triton, tma_loads  # noqa: E402


@pytest.fixture
def chosen(monkeypatch):
    """What each backward call chose: True where its tiles were loaded through descriptors."""
    choices = []

    def recording(tensors, addresses_known):
        choices.append(tma_loads(tensors, addresses_known))
        return choices[-1]

    monkeypatch.setattr(flash_triton, "tma_loads", recording)
    return choices


# (leading dims, N_q, N_k, d): power-of-two head dims, ragged ends, N_q != N_k both ways.
SHAPES = [
    ((1, 2), 50, 50, 32),
    *(
        pytest.param(*shape, marks=pytest.mark.slow)
        for shape in [
            ((1, 2), 37, 61, 16),
            ((2,), 64, 40, 64),
        ]
    ),
]


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("lead,n_q,n_k,d", SHAPES)
def test_descriptor_loads_match_float64_reference(lead, n_q, n_k, d, dtype, is_causal, monkeypatch, chosen):
    monkeypatch.setenv(TMA_ENV, "1")
    _check_against_reference(*_inputs(lead, n_q, n_k, d, dtype), is_causal)
    assert chosen == [True]


def test_descriptor_loads_give_the_pointer_loads_gradients(monkeypatch, chosen):
    q, k, v = _inputs((1, 2), 45, 45, 32, torch.float32)
    grad_out = torch.randn_like(q)
    grads = {}
    for setting in ("0", "1"):
        monkeypatch.setenv(TMA_ENV, setting)
        grads[setting] = _grads(lambda *a: FlashAttention2Triton.apply(*a, True), q, k, v, grad_out)
    assert chosen == [False, True]
    for name, by_pointer, by_descriptor in zip("qkv", grads["0"], grads["1"], strict=True):
        torch.testing.assert_close(by_descriptor, by_pointer, rtol=1e-6, atol=1e-6, msg=name)


def _bhnd(n=40, d=32, dtype=torch.float16, offset=0):
    flat = torch.randn(2 * 3 * n * d + offset, dtype=dtype, device=DEVICE)
    return flat[offset:].view(2, 3, n, d)


@pytest.mark.parametrize(
    "make,expected",
    [
        (lambda: _bhnd(), True),
        (lambda: _bhnd(d=48)[..., :32], True),  # rows 96 bytes apart: a strided view, still aligned
        (lambda: _bhnd(d=48), False),  # a head dim that is not a power of two is padded in the kernels
        (lambda: _bhnd(offset=1), False),  # a storage offset off the 16-byte alignment
        (lambda: torch.randn(1, 2, 40, 36, dtype=torch.float16, device=DEVICE)[..., :32], False),  # rows 72 bytes apart
    ],
    ids=["contiguous", "strided-rows", "head-dim-48", "offset", "rows-72-bytes"],
)
def test_descriptors_only_where_the_layout_allows(make, expected, monkeypatch):
    monkeypatch.setenv(TMA_ENV, "1")
    t = make()
    assert tma_loads((t, t.contiguous()), addresses_known=True) == expected
    assert tma_loads((t.contiguous(), t), addresses_known=False) == expected


def test_off_and_auto_settings(monkeypatch):
    t = _bhnd()
    monkeypatch.setenv(TMA_ENV, "0")
    assert not tma_loads((t,), addresses_known=True)
    monkeypatch.delenv(TMA_ENV, raising=False)
    has_tma = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
    assert tma_loads((t,), addresses_known=True) == has_tma


def test_a_bad_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv(TMA_ENV, "yes")
    with pytest.raises(ValueError, match=TMA_ENV):
        tma_loads((_bhnd(),), addresses_known=True)
