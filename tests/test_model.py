"""TransformerLM: shapes, causality, RoPE's relative-position property, bad input."""

import pytest
import torch

from lm_systems.model.config import MODEL_SIZES, ModelConfig
from lm_systems.model.transformer import RotaryEmbedding, TransformerLM


def tiny(**overrides) -> TransformerLM:
    config = ModelConfig.from_name("tiny", vocab_size=97, context_length=32, num_layers=2, **overrides)
    return TransformerLM(config)


@pytest.mark.parametrize("attention", ["naive", "sdpa"])
def test_changing_a_later_token_leaves_earlier_logits_unchanged(attention):
    model = tiny(attention=attention).double()
    tokens = torch.randint(0, 97, (2, 19))
    changed = tokens.clone()
    changed[:, 11] = (changed[:, 11] + 1) % 97
    before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :11], after[:, :11], rtol=0, atol=1e-12)
    assert (before[:, 11:] - after[:, 11:]).abs().max() > 1e-6  # and the change does reach later positions


def test_naive_and_sdpa_models_agree():
    naive = tiny(attention="naive").double()
    sdpa = tiny(attention="sdpa").double()
    sdpa.load_state_dict(naive.state_dict())
    tokens = torch.randint(0, 97, (3, 23))
    torch.testing.assert_close(naive(tokens), sdpa(tokens), rtol=1e-10, atol=1e-10)


def _compiled_backward_nodes(output: torch.Tensor) -> int:
    seen, stack = set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack.extend(child for child, _ in node.next_functions)
    return sum("CompiledFunction" in type(node).__name__ for node in seen)


@pytest.mark.slow
@pytest.mark.parametrize("runs, nodes", [(None, 3), ([2, 1], 2)])
def test_compiled_blocks_match_eager_and_keep_one_backward_node_per_block_or_run(runs, nodes):
    config = ModelConfig.from_name("tiny", vocab_size=97, context_length=32, num_layers=3)
    eager, compiled = TransformerLM(config), TransformerLM(config)
    compiled.load_state_dict(eager.state_dict())
    compiled.compile_blocks(runs, backend="aot_eager")  # the graph capture without code generation: fast on a CPU
    tokens = torch.randint(0, 97, (2, 17))
    expected, got = eager(tokens), compiled(tokens)
    # Each block's (or run's) gradients are ready when its own backward node ends, not all at the end of backward.
    assert _compiled_backward_nodes(got) == nodes
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    expected.square().mean().backward()
    got.square().mean().backward()
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_rope_scores_depend_only_on_relative_position():
    rope = RotaryEmbedding(d_head=16, max_len=64, theta=10_000.0)  # tables in float32
    q, k = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)

    def score(m: int, n: int) -> torch.Tensor:
        qm = rope(q[None], torch.tensor([m]))[0]
        kn = rope(k[None], torch.tensor([n]))[0]
        return qm @ kn

    for offset in (0, 3, 17):
        torch.testing.assert_close(score(5 + offset, 2 + offset), score(5, 2), rtol=1e-6, atol=1e-6)
    assert not torch.isclose(score(5, 2), score(5, 3))
    torch.testing.assert_close(rope(q[None], torch.tensor([7])).norm(), q.norm())  # a rotation
    x = torch.randn(2, 9, 16)
    torch.testing.assert_close(rope(x), rope(x, torch.arange(9)), rtol=0, atol=0)  # default: positions 0 … T-1


def test_logits_shape_and_parameter_count():
    model = tiny()
    assert model(torch.randint(0, 97, (2, 5))).shape == (2, 5, 97)
    c = model.config
    per_block = 4 * c.d_model**2 + 3 * c.d_model * c.d_ff + 2 * c.d_model
    expected = 2 * c.vocab_size * c.d_model + c.num_layers * per_block + c.d_model
    assert model.num_parameters() == expected
    assert (
        model.flops_per_token()
        == 6 * (expected - c.vocab_size * c.d_model - (2 * c.num_layers + 1) * c.d_model)
        + 6 * c.num_layers * c.context_length * c.d_model
    )


def test_named_sizes_match_the_cs336_table():
    assert (
        MODEL_SIZES["xl"].d_model,
        MODEL_SIZES["xl"].d_ff,
        MODEL_SIZES["xl"].num_layers,
        MODEL_SIZES["xl"].num_heads,
    ) == (1600, 6400, 48, 25)
    assert MODEL_SIZES["2.7b"].d_head == 80
    assert all(c.vocab_size == 10_000 for name, c in MODEL_SIZES.items() if name != "8b")
    # The CS336 2026 leaderboard step's model: 8.1B parameters.
    eight_b = MODEL_SIZES["8b"]
    assert (
        eight_b.d_model,
        eight_b.d_ff,
        eight_b.num_layers,
        eight_b.num_heads,
        eight_b.vocab_size,
        eight_b.context_length,
    ) == (4096, 11008, 34, 32, 151_936, 32_768)
    with torch.device("meta"):
        assert 8.0e9 < TransformerLM(eight_b).num_parameters() < 8.2e9


def test_sequence_longer_than_context_names_the_key():
    with pytest.raises(ValueError, match="context_length"):
        tiny()(torch.randint(0, 97, (1, 33)))


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"d_model": 130, "num_heads": 4}, "num_heads"),
        ({"d_model": 132, "num_heads": 4}, "RoPE"),
        ({"num_layers": 0}, "num_layers"),
    ],
)
def test_bad_shapes_name_the_key(overrides, key):
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_name("tiny", **overrides)


def test_unknown_size_and_attention_list_the_valid_names():
    with pytest.raises(ValueError, match="tiny, small"):
        ModelConfig.from_name("huge")
    with pytest.raises(ValueError, match="naive.*sdpa"):
        tiny(attention="flash3")


@pytest.mark.parametrize("runs", [[2, 2], [3, 0], []])
def test_runs_that_do_not_cover_the_blocks_are_refused(runs):
    model = TransformerLM(ModelConfig.from_name("tiny", vocab_size=97, num_layers=3))
    with pytest.raises(ValueError, match=r"add up to the model's 3"):
        model.compile_blocks(runs)
