"""Activation checkpointing: every policy gives the gradients of keeping everything, and keeps less for backward;
``keep_attention`` keeps the output of the Triton attention kernel's forward op, as of SDPA's, and runs it only once."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kept_tensors import kept_bytes
from torch.utils._python_dispatch import TorchDispatchMode

from lm_systems.model.config import ModelConfig
from lm_systems.model.recompute import RECOMPUTE_POLICIES, run_with_recompute
from lm_systems.model.transformer import TransformerLM

CONFIG = dict(vocab_size=61, context_length=24, d_model=32, num_layers=3, num_heads=4, d_ff=72, attention="sdpa")


def _model(policy: str, **overrides) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(ModelConfig(activation_checkpointing=policy, **{**CONFIG, **overrides})).double()


def _loss_and_grads(model: TransformerLM, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


RECOMPUTING = [policy for policy in RECOMPUTE_POLICIES if policy != "none"]


@pytest.mark.parametrize("policy", RECOMPUTING)
def test_recomputing_gives_the_gradients_of_keeping_everything(policy):
    tokens = torch.randint(0, CONFIG["vocab_size"], (2, 17))
    loss, grads = _loss_and_grads(_model("none"), tokens)
    recomputed_loss, recomputed_grads = _loss_and_grads(_model(policy), tokens)
    torch.testing.assert_close(recomputed_loss, loss, rtol=0, atol=0)
    for name, grad in grads.items():  # float64: the same operations again, up to the order of additions
        torch.testing.assert_close(recomputed_grads[name], grad, rtol=1e-12, atol=1e-12, msg=name)


MIXES = [("blocks", "keep_attention", "selective"), ("none", "selective", "blocks"), ("keep_attention", "none", "none")]


@pytest.mark.parametrize("mix", MIXES, ids="-".join)
def test_a_policy_per_block_gives_the_gradients_of_keeping_everything(mix):
    """What --model.activation_checkpointing auto builds: each block under its own policy."""
    tokens = torch.randint(0, CONFIG["vocab_size"], (2, 17))
    loss, grads = _loss_and_grads(_model("none"), tokens)
    torch.manual_seed(0)
    mixed = TransformerLM(ModelConfig(activation_checkpointing="auto", **CONFIG), block_recompute=mix).double()
    mixed_loss, mixed_grads = _loss_and_grads(mixed, tokens)
    torch.testing.assert_close(mixed_loss, loss, rtol=0, atol=0)
    for name, grad in grads.items():  # float64: the same operations again, up to the order of additions
        torch.testing.assert_close(mixed_grads[name], grad, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.slow  # compiles the blocks' graph three times
def test_a_policy_per_block_inside_compiled_blocks_gives_the_same_gradients():
    tokens = torch.randint(0, CONFIG["vocab_size"], (2, 17))
    compiled = {}
    for mix in (("none",) * 3, ("keep_projections", "blocks", "keep_attention")):
        torch.manual_seed(0)
        model = TransformerLM(ModelConfig(activation_checkpointing="auto", **CONFIG), block_recompute=mix).double()
        model.compile_blocks()  # one graph for the blocks, recompiled for each policy
        compiled[mix] = _loss_and_grads(model, tokens)[1]
    kept, mixed = compiled.values()
    for name, grad in kept.items():  # RMSNorm's float32 statistics: float32-level differences
        torch.testing.assert_close(mixed[name], grad, rtol=1e-6, atol=1e-7, msg=name)


def test_each_policy_keeps_less_for_backward():
    tokens = torch.randint(0, CONFIG["vocab_size"], (2, 25))
    kept = {policy: kept_bytes(_model(policy), tokens) for policy in RECOMPUTE_POLICIES}
    assert kept["blocks"] < kept["keep_attention"] < kept["keep_projections"] < kept["selective"] < kept["none"]
    # Each block more: "blocks" keeps its input alone, one (B, T, D) float64; the others keep far more.
    deeper = {
        policy: kept_bytes(_model(policy, num_layers=CONFIG["num_layers"] + 2), tokens) for policy in RECOMPUTE_POLICIES
    }
    per_block = {policy: (deeper[policy] - kept[policy]) / 2 for policy in RECOMPUTE_POLICIES}
    assert per_block["blocks"] == 2 * 24 * CONFIG["d_model"] * 8
    # "keep_attention" adds the attention's output (B, H, T, d_head) and its softmax statistics (B, H, T), float64.
    heads = CONFIG["num_heads"]
    assert per_block["keep_attention"] - per_block["blocks"] == 2 * 24 * (CONFIG["d_model"] + heads) * 8
    # "keep_projections" drops w2's output, (B, T, D).
    assert per_block["selective"] - per_block["keep_projections"] == 2 * 24 * CONFIG["d_model"] * 8
    # "selective" drops at least the SwiGLU's elementwise outputs (silu and the product, (B, T, d_ff) each).
    assert per_block["none"] - per_block["selective"] >= 2 * 2 * 24 * CONFIG["d_ff"] * 8


@pytest.mark.parametrize("policy", RECOMPUTING)
def test_recomputing_inside_a_compiled_block_gives_the_same_gradients(policy):
    tokens = torch.randint(0, CONFIG["vocab_size"], (2, 17))
    compiled = {}
    for name in ("none", policy):
        model = _model(name)
        model.compile_blocks()
        compiled[name] = _loss_and_grads(model, tokens)[1]
    for name, grad in compiled["none"].items():  # RMSNorm's float32 statistics: float32-level differences
        torch.testing.assert_close(compiled[policy][name], grad, rtol=1e-6, atol=1e-7, msg=name)


def test_an_unknown_policy_names_the_flag():
    with pytest.raises(ValueError, match="--model.activation_checkpointing"):
        ModelConfig(activation_checkpointing="everything", **CONFIG)


@pytest.mark.parametrize("policy", ["none", "keep_attention"])
def test_the_feed_forward_over_chunks_of_positions_gives_the_same_loss_and_gradients(policy):
    tokens = torch.randint(0, CONFIG["vocab_size"], (2, 24))  # 23 positions: chunks of 5, the last of 3
    loss, grads = _loss_and_grads(_model("none"), tokens)
    chunked_loss, chunked_grads = _loss_and_grads(_model(policy, ffn_chunk_tokens=5), tokens)
    torch.testing.assert_close(chunked_loss, loss, rtol=1e-14, atol=1e-14)
    for name, grad in grads.items():  # float64: the weights' gradients summed chunk by chunk
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-12, atol=1e-12, msg=name)


def test_chunking_the_feed_forward_runs_its_matmuls_on_chunks():
    chunked = _model("none", ffn_chunk_tokens=5).blocks[0].ffn
    rows = []
    chunked.w1.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[-2]))
    chunked(torch.randn(2, 23, CONFIG["d_model"], dtype=torch.float64))
    assert rows == [5, 5, 5, 5, 3]


def test_a_negative_feed_forward_chunk_names_the_flag():
    with pytest.raises(ValueError, match="--model.ffn_chunk_tokens"):
        ModelConfig(ffn_chunk_tokens=-1, **CONFIG)


class _TritonAttention(torch.autograd.Function):
    """Causal attention through the Triton kernels' ops, as FlashAttention2Triton calls them inside torch.compile
    (which cannot trace Triton's interpreter on a CPU): the forward op's output and logsumexp saved for the
    backward op."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out, lse = torch.ops.lm_systems.flash_attention_forward(q, k, v, True)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        return torch.ops.lm_systems.flash_attention_backward(*ctx.saved_tensors, grad_out, True)


class _AttentionForwards(TorchDispatchMode):
    """Counts the calls of the Triton attention forward op that run (not those a checkpoint answers from what it
    kept)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.ops.lm_systems.flash_attention_forward.default
        return func(*args, **(kwargs or {}))


def test_keep_attention_keeps_the_triton_forward_ops_output():
    """A block of projections around the Triton attention (float32: the CPU interpreter's; tiny shapes): backward
    runs the attention forward op again under ``blocks``, not under ``keep_attention``, and both give the gradients
    of keeping everything."""
    heads, positions, d_head = 2, 16, 16
    weights = torch.randn(4, heads * d_head, heads * d_head, requires_grad=True)
    x = torch.randn(1, positions, heads * d_head)

    def block(x: torch.Tensor) -> torch.Tensor:
        q, k, v = (F.linear(x, w).unflatten(-1, (heads, d_head)).transpose(1, 2) for w in weights[:3])  # (B, H, T, d)
        return x + F.linear(_TritonAttention.apply(q, k, v).transpose(1, 2).flatten(2), weights[3])

    (expected,) = torch.autograd.grad(block(x).square().sum(), weights)
    for policy, recomputed in (("blocks", 1), ("keep_attention", 0)):
        loss = run_with_recompute(block, x, policy).square().sum()
        with _AttentionForwards() as backward:
            (grad,) = torch.autograd.grad(loss, weights)
        assert backward.calls == recomputed, policy
        torch.testing.assert_close(grad, expected, rtol=0, atol=0, msg=policy)  # the same kernels on the same values


def test_keep_attention_keeps_the_eager_triton_forwards_output(monkeypatch):
    """The same block through ``FlashAttention2Triton.apply`` as an eager model calls it (its kernels launched
    directly, not through the op; on a GPU where there is one): backward runs the attention forward again under
    ``blocks``, not under ``keep_attention``; both give the gradients of keeping everything, and every forward,
    through the op or not, launches the eager kernels."""
    from lm_systems.attention import flash_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    heads, positions, d_head = 2, 16, 16
    weights = torch.randn(4, heads * d_head, heads * d_head, device=device, requires_grad=True)
    x = torch.randn(1, positions, heads * d_head, device=device)

    def block(x: torch.Tensor) -> torch.Tensor:
        q, k, v = (F.linear(x, w).unflatten(-1, (heads, d_head)).transpose(1, 2) for w in weights[:3])  # (B, H, T, d)
        attention = flash_triton.FlashAttention2Triton.apply(q, k, v, True)
        return x + F.linear(attention.transpose(1, 2).flatten(2), weights[3])

    (expected,) = torch.autograd.grad(block(x).square().sum(), weights)
    launched = []  # the kernel set of each attention forward
    forward = flash_triton._forward
    monkeypatch.setattr(
        flash_triton, "_forward", lambda kernels, *args: launched.append(kernels) or forward(kernels, *args)
    )
    for policy, recomputed in (("blocks", 1), ("keep_attention", 0)):
        loss = run_with_recompute(block, x, policy).square().sum()
        in_forward = len(launched)
        (grad,) = torch.autograd.grad(loss, weights)
        assert len(launched) - in_forward == recomputed, policy
        torch.testing.assert_close(grad, expected, rtol=0, atol=0, msg=policy)  # the same kernels on the same values
    assert all(kernels is flash_triton._EAGER_KERNELS for kernels in launched)


@pytest.mark.gpu
def test_on_a_gpu_compiled_blocks_keep_the_triton_attention_forward_under_keep_attention():
    """Compiled, flash_triton's forward is the op the policy names (on a CPU Inductor cannot compile Triton's
    interpreter): backward launches an attention forward kernel again under ``blocks``, never under
    ``keep_attention``, and both give the gradients of keeping everything."""
    from torch.profiler import ProfilerActivity, profile

    tokens = torch.randint(0, CONFIG["vocab_size"], (2, 25), device="cuda")
    launched, grads = {}, {}
    for policy in ("none", "blocks", "keep_attention"):
        model = _model(policy, attention="flash_triton", d_model=64).to("cuda", torch.float32)  # d_head 16
        model.compile_blocks()
        _loss_and_grads(model, tokens)  # compiles
        model.zero_grad(set_to_none=True)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as backward:
            loss.backward()
            torch.cuda.synchronize()
        kernels = [event.key for event in backward.key_averages() if event.device_type.name == "CUDA"]
        launched[policy] = sorted(name for name in kernels if "fwd" in name.lower())
        grads[policy] = {name: p.grad.clone() for name, p in model.named_parameters()}
    assert launched["blocks"] and not launched["keep_attention"] and not launched["none"], launched
    for policy in ("blocks", "keep_attention"):  # float32 (TF32 off by default): reassociated sums only
        for name, grad in grads["none"].items():
            torch.testing.assert_close(grads[policy][name], grad, rtol=1e-4, atol=1e-5, msg=f"{policy} {name}")
