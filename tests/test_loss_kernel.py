"""The Triton cross-entropy rows kernel (interpreted on the CPU) against float64 log-softmax: each row's loss, and the
gradient it writes over the logits, across blocks of the vocabulary, a ragged last block, lanes that see only padding,
and large logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lm_systems.model.loss_kernel import cross_entropy_rows_

# Loss: float32 statistics over float64-exact inputs (rtol 1e-5). Gradient: rounded once to the logits' dtype, within
# one ulp of the largest entry, 1/N (2^-10 for float16, 2^-7 for bfloat16: Triton's interpreter truncates where a GPU
# rounds to nearest).
GRAD_RTOL = {torch.float32: 1e-6, torch.float16: 2**-10, torch.bfloat16: 2**-7}


def _reference(logits: torch.Tensor, targets: torch.Tensor, tokens: int):
    x = logits.double()
    losses = -x.log_softmax(dim=1).gather(1, targets[:, None]).squeeze(1)
    grad = (x.softmax(dim=1) - F.one_hot(targets, x.shape[1])) / tokens
    return losses, grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "rows, vocab, block",
    [
        (5, 50, 16),  # four blocks, the last ragged
        (3, 5, 16),  # one block, most lanes padding only
        (4, 64, 64),  # one exact block
        (6, 300, None),  # the default block
    ],
)
def test_losses_and_gradient_match_float64(dtype, rows, vocab, block):
    logits = (torch.randn(rows, vocab) * 4).to(dtype)
    targets = torch.randint(0, vocab, (rows,))
    targets[0] = vocab - 1  # in the last, ragged block
    ref_losses, ref_grad = _reference(logits, targets, tokens=3 * rows)
    grad = logits.clone()
    losses = cross_entropy_rows_(grad, targets, tokens=3 * rows, block=block)
    assert losses.dtype == torch.float32 and grad.dtype == dtype
    torch.testing.assert_close(losses.double(), ref_losses, rtol=1e-5, atol=1e-5)
    assert (grad.double() - ref_grad).abs().max() <= GRAD_RTOL[dtype] / (3 * rows)


def test_without_tokens_only_the_losses_are_computed_and_the_logits_are_kept():
    logits = torch.randn(4, 37)
    targets = torch.randint(0, 37, (4,))
    kept = logits.clone()
    losses = cross_entropy_rows_(logits, targets, block=8)
    assert torch.equal(logits, kept)
    torch.testing.assert_close(losses.double(), _reference(kept, targets, 1)[0], rtol=1e-5, atol=1e-5)


def test_large_logits_stay_finite():
    """exp of a logit of 1e4 overflows float32; the running maximum keeps every term at most 1."""
    logits = torch.tensor([[1e4, 1e4 - 1.0, -1e4, 0.0], [-50.0, -60.0, -70.0, -80.0]])
    targets = torch.tensor([1, 3])
    ref_losses, ref_grad = _reference(logits, targets, tokens=2)
    losses = cross_entropy_rows_(logits, targets, tokens=2, block=2)
    torch.testing.assert_close(losses.double(), ref_losses, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits.double(), ref_grad, rtol=0, atol=1e-6)


def test_rows_of_a_strided_view_are_read_at_their_stride():
    """A chunk of rows cut from wider storage: each program starts at its row's own offset."""
    wide = torch.randn(4, 40)
    logits, targets = wide[:, :30], torch.randint(0, 30, (4,))
    ref_losses, ref_grad = _reference(logits, targets, tokens=4)
    losses = cross_entropy_rows_(logits, targets, tokens=4, block=8)
    torch.testing.assert_close(losses.double(), ref_losses, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits.double(), ref_grad, rtol=0, atol=1e-6)


def test_logits_strided_along_the_vocabulary_are_refused():
    with pytest.raises(ValueError, match="unit stride along vocab"):
        cross_entropy_rows_(torch.randn(8, 3).T, torch.zeros(3, dtype=torch.int64))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_on_a_gpu_at_a_large_vocabulary_the_gradient_is_rounded_to_nearest(dtype):
    """The 8B model's vocabulary (37 blocks, the last ragged), compiled for the device: half an ulp of 1/N."""
    rows, vocab = 64, 151_936
    logits = (torch.randn(rows, vocab, device="cuda") * 4).to(dtype)
    targets = torch.randint(0, vocab, (rows,), device="cuda")
    ref_losses, ref_grad = _reference(logits.cpu(), targets.cpu(), tokens=rows)
    losses = cross_entropy_rows_(logits, targets, tokens=rows)
    torch.testing.assert_close(losses.double().cpu(), ref_losses, rtol=1e-5, atol=1e-5)
    assert (logits.double().cpu() - ref_grad).abs().max() <= GRAD_RTOL[dtype] / 2 / rows
