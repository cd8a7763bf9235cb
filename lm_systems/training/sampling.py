"""Nucleus sampling from a TransformerLM (plain PyTorch): token ids in, token ids out, or text through a tokenizer."""

from __future__ import annotations

import warnings

import torch
from tokenizers import Tokenizer

from lm_systems.data.printable import printable_decode
from lm_systems.data.tokenizer import END_OF_TEXT
from lm_systems.model.transformer import TransformerLM
from lm_systems.training.nonfinite import divergence_advice


@torch.no_grad()
def sample(
    model: TransformerLM,
    prompt_ids: list[int],
    max_new_tokens: int = 64,
    temperature: float = 0.8,
    top_p: float = 0.9,
    eot_id: int | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Continue ``prompt_ids`` by nucleus sampling; stops after ``max_new_tokens`` or at ``eot_id``.

    A model whose logits are not finite (diverged weights) cannot be sampled: sampling stops there with a
    warning instead of failing inside ``torch.multinomial``, so a run's closing sample never crashes it.
    """
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], device=device)
    new: list[int] = []
    was_training = model.training
    model.eval()
    for _ in range(max_new_tokens):
        logits = model(ids[:, -model.config.context_length :])[0, -1].float()  # (V,)
        if not bool(logits.isfinite().all()):
            warnings.warn(
                f"sampling stopped after {len(new)} tokens: the model's logits are not finite (NaN or inf weights; "
                f"training diverged: {divergence_advice()})",
                RuntimeWarning,
                stacklevel=2,
            )
            break
        if temperature == 0:
            next_id = int(logits.argmax())
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            sorted_probs, order = probs.sort(descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            outside = sorted_probs.cumsum(0) - sorted_probs > top_p
            sorted_probs[outside] = 0.0
            choice = torch.multinomial(sorted_probs.cpu(), 1, generator=generator)
            next_id = int(order[choice.to(device)])
        if next_id == eot_id:
            break
        new.append(next_id)
        ids = torch.cat([ids, torch.tensor([[next_id]], device=device)], dim=1)
    model.train(was_training)
    return new


def sample_text(model: TransformerLM, tokenizer: Tokenizer, prompt: str, **kwargs) -> str:
    """``sample`` on text: encode the prompt, decode prompt + continuation as printable text (bytes that are not,
    as ``\\xNN`` escapes: :mod:`lm_systems.data.printable`)."""
    prompt_ids = tokenizer.encode(prompt).ids
    eot_id = tokenizer.token_to_id(END_OF_TEXT)
    return printable_decode(tokenizer, prompt_ids + sample(model, prompt_ids, eot_id=eot_id, **kwargs))
