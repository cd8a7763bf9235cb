"""fused_linear_cross_entropy against a float64 reference on fresh random inputs: loss and both gradients, in float32,
bfloat16 and under autocast, over ragged chunks and odd sizes, with each chunk kernel (Triton's interpreted on the
CPU); inside torch.compile; and its memory, read by a dispatch-mode spy that sees every tensor an op makes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lm_systems.model import loss_kernel
from lm_systems.model.loss import CHUNK_LOGITS_BYTES, MAX_16BIT_SUMS, default_chunk_tokens, fused_linear_cross_entropy

# (dtype, rtol): max |got - reference| <= rtol * max |reference|, per output.
# float32: unit roundoff 6e-8; each output sums at most a few hundred rounded terms (a dot product over d_model, a
#   logsumexp over the vocabulary, the weight gradient over the tokens), so 1e-5 leaves a wide margin.
# bfloat16: unit roundoff 2^-9 = 2e-3; the chunk's logits and their gradient are rounded to bf16 before the matmuls
#   that consume them and the gradients are stored in bf16, so each output carries a few bf16 roundings: 2e-2.
FLOAT32 = (torch.float32, 1e-5)
BFLOAT16 = (torch.bfloat16, 2e-2)


def _inputs(tokens: int, d_model: int, vocab: int, dtype: torch.dtype):
    hidden = torch.randn(tokens, d_model, dtype=dtype, requires_grad=True)
    # Scaled by 1/sqrt(d_model), as an initialised head is: logits of order one, as in training.
    weight = (torch.randn(vocab, d_model) / d_model**0.5).to(dtype).requires_grad_()
    return hidden, weight, torch.randint(0, vocab, (tokens,))


def _reference(hidden, weight, targets, grad_scale: float = 1.0):
    """The loss and both gradients in float64 from the same (rounded) inputs, by plain autograd over full logits."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    loss = -(h @ w.T).log_softmax(dim=1).gather(1, targets[:, None]).mean()
    (loss * grad_scale).backward()
    return loss.detach(), h.grad, w.grad


def _assert_close(got: torch.Tensor, reference: torch.Tensor, rtol: float) -> None:
    error = (got.double() - reference).abs().max().item()
    assert error <= rtol * reference.abs().max().item(), (
        f"max error {error:.3g} against max {reference.abs().max():.3g}"
    )


@pytest.mark.parametrize("chunk_kernel", ["eager", "triton"])
@pytest.mark.parametrize("dtype, rtol", [FLOAT32, BFLOAT16])
@pytest.mark.parametrize(
    "tokens, d_model, vocab, chunk_tokens",
    [
        (64, 16, 50, 16),  # even chunks
        (37, 11, 23, 5),  # odd sizes, ragged last chunk
        (13, 7, 29, 100),  # one chunk larger than all tokens
        (9, 5, 31, 1),  # a token per chunk
        (33, 12, 17, None),  # the default chunk
    ],
)
def test_loss_and_gradients_match_float64(chunk_kernel, dtype, rtol, tokens, d_model, vocab, chunk_tokens):
    hidden, weight, targets = _inputs(tokens, d_model, vocab, dtype)
    loss = fused_linear_cross_entropy(hidden, weight, targets, chunk_tokens, chunk_kernel=chunk_kernel)
    loss.backward()
    ref_loss, ref_hidden, ref_weight = _reference(hidden, weight, targets)
    assert loss.dtype == torch.float32 and hidden.grad.dtype == weight.grad.dtype == dtype
    _assert_close(loss, ref_loss, rtol)
    _assert_close(hidden.grad, ref_hidden, rtol)
    _assert_close(weight.grad, ref_weight, rtol)


def test_a_bf16_weight_gradient_summed_over_many_chunks_keeps_bf16_accuracy():
    """512 one-token chunks: a bf16 running sum would round at each one and drift well past the bound."""
    hidden, weight, targets = _inputs(512, 8, 16, torch.bfloat16)
    fused_linear_cross_entropy(hidden, weight, targets, chunk_tokens=1).backward()
    _assert_close(weight.grad, _reference(hidden, weight, targets)[2], BFLOAT16[1])


@pytest.mark.parametrize(
    "tokens, float32_sum",
    [
        (16 * MAX_16BIT_SUMS, False),
        (16 * MAX_16BIT_SUMS + 1, True),  # one chunk more, of one token
    ],
)
def test_a_bf16_weight_gradient_is_summed_in_bf16_over_few_chunks_and_in_float32_over_more(tokens, float32_sum):
    d_model, vocab = 8, 24
    hidden, weight, targets = _inputs(tokens, d_model, vocab, torch.bfloat16)
    with _AllocationSpy() as spy:
        fused_linear_cross_entropy(hidden, weight, targets, chunk_tokens=16).backward()
    assert (
        ((vocab, d_model), torch.float32) in spy.tensors
        if float32_sum
        else ((vocab, d_model), torch.float32) not in spy.tensors
    )
    _assert_close(weight.grad, _reference(hidden, weight, targets)[2], BFLOAT16[1])


@pytest.mark.parametrize("chunk_kernel", ["eager", "compiled", "triton"])
def test_grad_output_scales_both_gradients(chunk_kernel):
    hidden, weight, targets = _inputs(21, 10, 19, torch.float32)
    (fused_linear_cross_entropy(hidden, weight, targets, 4, chunk_kernel=chunk_kernel) * 3).backward()
    _, ref_hidden, ref_weight = _reference(hidden, weight, targets, grad_scale=3.0)
    _assert_close(hidden.grad, ref_hidden, FLOAT32[1])
    _assert_close(weight.grad, ref_weight, FLOAT32[1])


@pytest.mark.parametrize("frozen", ["hidden", "weight"])
def test_only_the_inputs_that_need_a_gradient_get_one(frozen):
    hidden, weight, targets = _inputs(17, 6, 11, torch.float32)
    {"hidden": hidden, "weight": weight}[frozen].requires_grad_(False)
    fused_linear_cross_entropy(hidden, weight, targets, 5).backward()
    _, ref_hidden, ref_weight = _reference(hidden, weight, targets)
    for name, tensor, reference in (("hidden", hidden, ref_hidden), ("weight", weight, ref_weight)):
        if name == frozen:
            assert tensor.grad is None
        else:
            _assert_close(tensor.grad, reference, FLOAT32[1])


def test_backward_does_not_read_the_weight():
    """ZeRO-3 frees the gathered head's storage after forward; the gradients were made in forward."""
    hidden, weight, targets = _inputs(19, 6, 13, torch.float32)
    _, ref_hidden, ref_weight = _reference(hidden, weight, targets)
    full = weight.detach().clone().requires_grad_()
    loss = fused_linear_cross_entropy(hidden, full, targets, 4)
    full.data.untyped_storage().resize_(0)
    loss.backward()
    _assert_close(hidden.grad, ref_hidden, FLOAT32[1])
    _assert_close(full.grad, ref_weight, FLOAT32[1])


def test_a_second_backward_through_one_graph_says_it_is_not_supported():
    hidden, weight, targets = _inputs(8, 4, 7, torch.float32)
    loss = fused_linear_cross_entropy(hidden, weight, targets, 3)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


class _AllocationSpy(TorchDispatchMode):
    """Records the shape and dtype of every tensor an op returns, and the dtypes each matmul multiplies."""

    def __init__(self):
        super().__init__()
        self.tensors: list[tuple[tuple[int, ...], torch.dtype]] = []
        self.matmul_dtypes: set[torch.dtype] = set()

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return [shape for shape, _ in self.tensors]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            self.matmul_dtypes |= {a.dtype for a in args if isinstance(a, torch.Tensor) and a.ndim == 2}
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.tensors.append((tuple(tensor.shape), tensor.dtype))
        return out

    def largest_bytes(self) -> int:
        """Of any tensor made (Triton's interpreter copies a kernel's arguments as bytes)."""
        return max(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in self.tensors)


TOKENS, D_MODEL, VOCAB, CHUNK = 64, 8, 50, 16  # full logits 3200 elements; a chunk's 800; the gradients 512 and 400


def test_the_spy_sees_the_full_logits_of_the_plain_loss():
    hidden, weight, targets = _inputs(TOKENS, D_MODEL, VOCAB, torch.float32)
    with _AllocationSpy() as spy:
        F.cross_entropy(hidden @ weight.T, targets).backward()
    assert (TOKENS, VOCAB) in spy.shapes


@pytest.mark.parametrize("chunk_kernel", ["eager", "compiled", "triton"])
def test_forward_and_backward_never_hold_more_than_one_chunk_of_logits(chunk_kernel):
    hidden, weight, targets = _inputs(TOKENS, D_MODEL, VOCAB, torch.float32)
    fused_linear_cross_entropy(hidden, weight, targets, CHUNK, chunk_kernel=chunk_kernel)  # compiled outside the spy
    with _AllocationSpy() as spy:
        fused_linear_cross_entropy(hidden, weight, targets, CHUNK, chunk_kernel=chunk_kernel).backward()
    assert (TOKENS, VOCAB) not in spy.shapes
    assert spy.largest_bytes() == CHUNK * VOCAB * 4  # float32


@pytest.mark.parametrize("chunk_kernel, float32_copy", [("eager", True), ("triton", False)])
def test_the_triton_chunk_kernel_makes_no_float32_copy_of_bf16_logits(chunk_kernel, float32_copy):
    hidden, weight, targets = _inputs(TOKENS, D_MODEL, VOCAB, torch.bfloat16)
    with _AllocationSpy() as spy:
        fused_linear_cross_entropy(hidden, weight, targets, CHUNK, chunk_kernel=chunk_kernel).backward()
    assert (((CHUNK, VOCAB), torch.float32) in spy.tensors) == float32_copy


def test_without_gradients_only_the_loss_is_computed():
    hidden, weight, targets = _inputs(TOKENS, D_MODEL, VOCAB, torch.float32)
    with torch.no_grad(), _AllocationSpy() as spy:
        loss = fused_linear_cross_entropy(hidden, weight, targets, CHUNK)
    assert not {(TOKENS, D_MODEL), (VOCAB, D_MODEL)} & set(spy.shapes)  # no gradient buffers
    assert spy.largest_bytes() == CHUNK * VOCAB * 4  # float32
    assert not loss.requires_grad
    _assert_close(loss, _reference(hidden, weight, targets)[0], FLOAT32[1])


# Either way to the gradient-free path: inputs that need no gradient, or grad mode off.
@pytest.mark.parametrize("chunk_kernel, frozen", [("eager", False), ("triton", True)])
def test_without_gradients_the_ragged_last_chunk_counts_in_the_mean(chunk_kernel, frozen):
    hidden, weight, targets = _inputs(37, 11, 23, torch.float32)  # chunks of 5, the last of 2
    if frozen:
        hidden.requires_grad_(False), weight.requires_grad_(False)
    with torch.set_grad_enabled(frozen):
        loss = fused_linear_cross_entropy(hidden, weight, targets, 5, chunk_kernel=chunk_kernel)
    assert not loss.requires_grad
    _assert_close(loss, _reference(hidden, weight, targets)[0], FLOAT32[1])


def _logits_of_ten_thousand(tokens: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Integer-valued hidden (tokens, 2) and weight (vocab, 2) whose products, logits within ±1e4 with both ends
    reached, are exact in float32: the reference sees the very logits the kernels do."""
    hidden = torch.randint(-100, 101, (tokens, 2)).float()
    weight = torch.randint(-50, 51, (vocab, 2)).float()
    hidden[:2] = torch.tensor([[100.0, 100.0], [-100.0, -100.0]])
    weight[0] = 50.0
    return hidden.requires_grad_(), weight.requires_grad_(), torch.randint(0, vocab, (tokens,))


# float32's spacing at 1e4 is 2^-10: the logsumexp each row subtracts is rounded by up to 2^-11, which the softmax
# carries as a relative error of about 5e-4 into the gradients. The losses, of order 1e4, are exact but for it.
# Compiling the two chunk functions for these shapes takes ~10 s on two busy cores: compiled is in the full suite.
@pytest.mark.parametrize("chunk_kernel", ["eager", pytest.param("compiled", marks=pytest.mark.slow), "triton"])
def test_logits_of_ten_thousand_give_finite_exact_losses_and_gradients(chunk_kernel):
    hidden, weight, targets = _logits_of_ten_thousand(21, 19)
    assert (hidden @ weight.T).abs().max() == 1e4
    loss = fused_linear_cross_entropy(hidden, weight, targets, 4, chunk_kernel=chunk_kernel)  # ragged: 5 × 4 + 1
    loss.backward()
    ref_loss, ref_hidden, ref_weight = _reference(hidden, weight, targets)
    _assert_close(loss, ref_loss, FLOAT32[1])
    _assert_close(hidden.grad, ref_hidden, 2e-3)
    _assert_close(weight.grad, ref_weight, 2e-3)
    with torch.no_grad():
        unused = fused_linear_cross_entropy(hidden, weight, targets, 4, chunk_kernel=chunk_kernel)
    _assert_close(unused, ref_loss, FLOAT32[1])


def test_under_autocast_the_matmuls_run_in_its_dtype_and_the_gradients_keep_the_inputs():
    hidden, weight, targets = _inputs(30, 12, 21, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16), _AllocationSpy() as spy:
        loss = fused_linear_cross_entropy(hidden, weight, targets, 7)
    loss.backward()
    assert spy.matmul_dtypes == {torch.bfloat16}
    assert loss.dtype == hidden.grad.dtype == weight.grad.dtype == torch.float32
    # The reference multiplies the bf16-rounded inputs, as autocast does; bf16 bound for the rounded logits.
    rounded = [t.detach().bfloat16() for t in (hidden, weight)]
    for got, reference in zip((loss, hidden.grad, weight.grad), _reference(*rounded, targets), strict=True):
        _assert_close(got, reference, BFLOAT16[1])


class _TinyLM(torch.nn.Module):
    def __init__(self, vocab: int, d_model: int, chunk_kernel: str):
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab, d_model)
        self.proj = torch.nn.Linear(d_model, d_model)
        self.head = torch.nn.Linear(d_model, vocab, bias=False)
        self.chunk_kernel = chunk_kernel

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.proj(self.embedding(tokens)))
        return fused_linear_cross_entropy(hidden, self.head.weight, targets, 8, chunk_kernel=self.chunk_kernel)


@pytest.mark.parametrize("chunk_kernel", ["eager", "compiled", "triton"])
def test_inside_a_compiled_module(chunk_kernel):
    """The compiled graph breaks at the loss and hands the hidden states' gradient back through its own backward."""
    model = _TinyLM(23, 16, chunk_kernel)
    tokens, targets = torch.randint(0, 23, (2, 24)).unbind(0)
    loss = torch.compile(model)(tokens, targets)
    loss.backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    hidden = torch.tanh(model.proj(model.embedding(tokens)))
    ref_loss = F.cross_entropy((hidden.double() @ model.head.weight.double().T), targets)
    ref_loss.backward()
    _assert_close(loss, ref_loss.detach(), FLOAT32[1])
    for grad, param in zip(got, model.parameters(), strict=True):
        _assert_close(grad, param.grad.double(), FLOAT32[1])


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda h, w, t: (h[None], w, t), "hidden must be"),
        (lambda h, w, t: (h[:0], w, t[:0]), "hidden must be"),
        (lambda h, w, t: (h, w[:, :-1], t), "weight must be"),
        (lambda h, w, t: (h, w, t.int()), "targets must be int64"),
        (lambda h, w, t: (h, w, t[:-1]), "targets must be int64"),
        (lambda h, w, t: (h.long(), w, t), "floating point"),
    ],
)
def test_bad_inputs_are_refused_at_the_entry(change, message):
    with pytest.raises(ValueError, match=message):
        fused_linear_cross_entropy(*change(*_inputs(6, 4, 5, torch.float32)))


@pytest.mark.parametrize("chunk_tokens", [0, -3, 2.5])
def test_bad_chunk_sizes_are_refused(chunk_tokens):
    with pytest.raises(ValueError, match="chunk_tokens"):
        fused_linear_cross_entropy(*_inputs(6, 4, 5, torch.float32), chunk_tokens)


def test_an_unknown_chunk_kernel_is_refused_by_name():
    with pytest.raises(ValueError, match="chunk_kernel must be one of triton, compiled, eager, got 'cuda'"):
        fused_linear_cross_entropy(*_inputs(6, 4, 5, torch.float32), chunk_kernel="cuda")


def test_the_triton_chunk_kernel_on_a_cpu_without_the_interpreter_says_what_to_use(monkeypatch):
    monkeypatch.setattr(loss_kernel, "INTERPRETED", False)  # a kernel compiled for a GPU
    with pytest.raises(ValueError, match="use 'eager' here"):
        fused_linear_cross_entropy(*_inputs(6, 4, 5, torch.float32), chunk_kernel="triton")


@pytest.mark.parametrize("vocab", [151936, 50257, 1004, 10**9])
def test_the_default_chunk_keeps_its_float32_logits_within_the_budget(vocab):
    tokens = default_chunk_tokens(vocab)
    assert tokens >= 1 and (tokens * vocab * 4 <= CHUNK_LOGITS_BYTES or tokens == 1)
    assert tokens & (tokens - 1) == 0  # a power of two
    assert 2 * tokens * vocab * 4 > CHUNK_LOGITS_BYTES  # the largest one
    assert default_chunk_tokens(151936) == 4096


@pytest.mark.gpu
@pytest.mark.parametrize("chunk_kernel", ["compiled", "triton"])
def test_gpu_bf16_matches_float64_and_stays_under_the_full_logits(chunk_kernel):
    tokens, d_model, vocab, chunk = 2048, 128, 32000, 256  # full float32 logits 250 MiB; a chunk's 31 MiB
    hidden, weight, targets = (
        t.detach().cuda().requires_grad_(t.is_floating_point()) for t in _inputs(tokens, d_model, vocab, torch.bfloat16)
    )
    fused_linear_cross_entropy(hidden, weight, targets, chunk, chunk_kernel=chunk_kernel).backward()  # compiles
    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = fused_linear_cross_entropy(hidden, weight, targets, chunk, chunk_kernel=chunk_kernel)
    loss.backward()
    extra = torch.cuda.max_memory_allocated() - before
    # Eight chunks: the weight's gradient summed in bf16 (7.8 MiB). Triton's kernel holds a chunk's bf16 logits
    # (15.6 MiB) and the two gradients; compiled chunks also a float32 copy. The plain path's float32 logits are 250.
    gradients = (vocab + tokens) * d_model * 2
    assert extra < 1.1 * (chunk * vocab * (2 if chunk_kernel == "triton" else 6) + gradients)
    for got, reference in zip(
        (loss, hidden.grad, weight.grad), _reference(hidden.cpu(), weight.cpu(), targets.cpu()), strict=True
    ):
        _assert_close(got.cpu(), reference, BFLOAT16[1])
