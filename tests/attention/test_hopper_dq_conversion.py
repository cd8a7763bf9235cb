"""The Hopper backward's dQ conversion (``hopper.dq_conversion``): scale, transpose and cast in one kernel, against
the same in float64 PyTorch. On the CPU through Triton's interpreter (fp32, fp16), on a GPU as it comes."""

import sys

import pytest
import torch

if sys.platform != "linux":  # triton is a dependency on Linux only; there a broken install must fail
    pytest.skip("triton is installed on Linux only", allow_module_level=True)

from test_flash_triton import DEVICE  # noqa: E402

from lm_systems.attention.hopper.dq_conversion import ROWS, dq_from_accumulator  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("batch,heads,n_q,d", [(1, 1, ROWS, 16), (2, 3, ROWS + 5, 32), (1, 2, 3, 64)])
def test_dq_is_the_scaled_transpose_of_the_accumulator(batch, heads, n_q, d, dtype):
    padded = (n_q + 3) // 4 * 4  # the accumulator's rows, as the one pass allocates it
    acc = torch.randn(batch * heads, d, padded, device=DEVICE)
    acc[..., n_q:] = float("nan")  # the padding past N_q must never be read into dQ
    dq = torch.full((batch, heads, n_q, d), float("nan"), dtype=dtype, device=DEVICE)
    dq_from_accumulator(acc, dq, 0.125)
    want = (acc[..., :n_q].double() * 0.125).transpose(-1, -2).unflatten(0, (batch, heads))
    torch.testing.assert_close(dq.double(), want.to(dtype).double(), rtol=0, atol=0)


def test_dq_of_a_strided_view_fills_only_its_elements():
    """dQ as the package hands it over: a (B, H, N, d) view of a (B, N, H, d) tensor."""
    batch, heads, n_q, d = 2, 3, 70, 16
    acc = torch.randn(batch * heads, d, 72, device=DEVICE)
    storage = torch.zeros(batch, n_q, heads, d, device=DEVICE)
    dq_from_accumulator(acc, storage.transpose(1, 2), 0.5)
    want = (acc[..., :n_q] * 0.5).transpose(-1, -2).unflatten(0, (batch, heads)).transpose(1, 2)
    torch.testing.assert_close(storage, want, rtol=0, atol=0)


def test_an_accumulator_of_the_wrong_shape_is_refused_before_a_launch():
    with pytest.raises(ValueError, match="the accumulator must be"):
        dq_from_accumulator(torch.zeros(2, 16, 8), torch.zeros(1, 2, 12, 16), 1.0)
