"""RandomWindowsLM: a LitLM for tests that train a few steps without data of their own (checkpointing, the schedule)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from lm_systems.lit_module import LitLM


class RandomWindowsLM(LitLM):
    """A one-layer LitLM on random token windows, which it brings itself (no datamodule, no tokenizer)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(
            size="tiny",
            vocab_size=32,
            context_length=8,
            d_model=16,
            num_layers=1,
            num_heads=2,
            d_ff=32,
            sample_prompt="",
            **kwargs,
        )

    def train_dataloader(self):
        tokens = torch.randint(0, 32, (256, 9), generator=torch.Generator().manual_seed(0))  # (B, T + 1) windows
        return DataLoader(tokens, batch_size=4)
