"""TransformerLM under autocast: matmul outputs in low precision, the residual stream, parameters and gradients
in float32 (docs/mixed_precision.md). Output dtypes are read by forward hooks on the model's own modules."""

import pytest
import torch
import torch.nn.functional as F

from lm_systems.model.config import ModelConfig
from lm_systems.model.transformer import TransformerLM

FP32 = torch.float32
# Expected output dtype per module, LOW standing for autocast's dtype.
LOW = "low"
EXPECTED = {
    "embedding": FP32,  # a lookup, not a matmul: autocast leaves it alone
    "attn_norm": FP32,  # RMSNorm keeps its input's dtype, and its input is the fp32 residual stream
    "attn": LOW,  # ends in the output projection, a matmul
    "ffn_norm": FP32,
    "ffn": LOW,  # SwiGLU ends in w2, a matmul
    "block": FP32,  # x + attn(...): fp32 + low promotes back to fp32, so the residual stream stays fp32
    "final_norm": FP32,
    "lm_head": LOW,  # the logits
}


@pytest.mark.parametrize(
    "device, low",
    [
        ("cpu", torch.bfloat16),
        pytest.param("cuda", torch.float16, marks=pytest.mark.gpu),
        pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu),
    ],
)
@pytest.mark.parametrize("attention", ["naive", "sdpa"])
def test_autocast_keeps_the_residual_stream_parameters_and_gradients_in_fp32(device, low, attention):
    config = ModelConfig.from_name("tiny", vocab_size=61, context_length=16, num_layers=2, attention=attention)
    model = TransformerLM(config).to(device)
    blocks = list(model.blocks)
    watched = {
        "embedding": [model.embedding],
        "final_norm": [model.final_norm],
        "lm_head": [model.lm_head],
        "block": blocks,
        **{name: [getattr(b, name) for b in blocks] for name in ("attn_norm", "attn", "ffn_norm", "ffn")},
    }
    seen: dict[str, list[torch.dtype]] = {name: [] for name in watched}
    hooks = [
        module.register_forward_hook(lambda _m, _i, out, name=name: seen[name].append(out.dtype))
        for name, modules in watched.items()
        for module in modules
    ]
    tokens = torch.randint(0, 61, (2, 17), device=device)

    with torch.autocast(device, dtype=low):
        logits = model(tokens[:, :-1])  # (B, T, V)
    F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
    for hook in hooks:
        hook.remove()

    expected = {name: [low if dtype == LOW else dtype] * len(watched[name]) for name, dtype in EXPECTED.items()}
    assert seen == expected
    assert logits.dtype == low
    assert {p.dtype for p in model.parameters()} == {FP32}
    assert {p.grad.dtype for p in model.parameters()} == {FP32}
