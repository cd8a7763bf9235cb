"""Sampling: greedy equals argmax decoding, top-p keeps only the nucleus, EOT stops, non-finite logits stop."""

import pytest
import torch

from lm_systems.model.config import ModelConfig
from lm_systems.model.transformer import TransformerLM
from lm_systems.training.sampling import sample


@pytest.fixture
def model():
    return TransformerLM(ModelConfig.from_name("tiny", vocab_size=50, context_length=16, num_layers=1))


def test_greedy_sampling_is_argmax_decoding_and_crops_to_the_context(model):
    prompt = [1, 2, 3]
    out = sample(model, prompt, max_new_tokens=20, temperature=0)
    ids = list(prompt)
    for _ in range(20):
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids[-16:]]))[0, -1].argmax()))
    assert out == ids[3:]


def test_tiny_top_p_is_greedy(model):
    greedy = sample(model, [4, 5], max_new_tokens=8, temperature=0)
    nucleus = sample(
        model, [4, 5], max_new_tokens=8, temperature=1.0, top_p=1e-6, generator=torch.Generator().manual_seed(3)
    )
    assert nucleus == greedy


def test_sampling_stops_at_end_of_text(model):
    first = sample(model, [7], max_new_tokens=1, temperature=0)[0]
    assert sample(model, [7], max_new_tokens=5, temperature=0, eot_id=first) == []


def test_bad_arguments_name_them(model):
    with pytest.raises(ValueError, match="top_p"):
        sample(model, [1], top_p=0)
    with pytest.raises(ValueError, match="prompt is empty"):
        sample(model, [])


def test_a_model_with_non_finite_weights_stops_sampling_with_a_warning(model):
    """The closing sample of a diverged run must not crash it (torch.multinomial rejects NaN probabilities)."""
    with torch.no_grad():
        model.lm_head.weight[3, 0] = float("nan")
    for temperature in (0.8, 0):
        with pytest.warns(RuntimeWarning, match="sampling stopped after 0 tokens: the model's logits are not finite"):
            assert sample(model, [1, 2], max_new_tokens=5, temperature=temperature) == []
