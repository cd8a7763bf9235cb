"""The leaderboard recipe scaled down to a CPU, through train.py: a model of the 8B's proportions (d_ff / d_model
2.6875, vocabulary / d_model 37.1) on synthetic tokens, under every activation checkpointing policy with the fused
loss, trains to the weights of the plain path (every activation kept, the whole logits, then their cross-entropy)."""

from __future__ import annotations

import math
import re

import pytest
import torch
from environment import environment_kept

from lm_systems.files.checkpoint_io import read_checkpoint
from lm_systems.model.recompute import RECOMPUTE_POLICIES
from train import main

EIGHT_B_SHAPED = [
    "--model.size",
    "8b",
    "--model.d_model",
    "64",
    "--model.num_heads",
    "4",
    "--model.d_ff",
    "172",
    "--model.num_layers",
    "2",
    "--model.context_length",
    "32",
    "--data.vocab_size",
    "2374",
    "--data.synthetic",
    "true",
    "--data.batch_size",
    "2",
    "--data.val_batches",
    "1",
    "--max_steps",
    "3",
    "--model.warmup_steps",
    "1",
    "--model.sample_prompt",
    "",
    "--trainer.val_check_interval",
    "3",
    "--trainer.logger",
    "false",
    "--trainer.enable_progress_bar",
    "false",
]


def _final_weights(tmp_path, name: str, *flags: str) -> dict[str, torch.Tensor]:
    root = tmp_path / name
    main([*EIGHT_B_SHAPED, "--trainer.default_root_dir", str(root), *flags])
    (checkpoint,) = root.rglob("last.ckpt")
    return read_checkpoint(checkpoint)["state_dict"]


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> dict[str, torch.Tensor]:
    with environment_kept():
        return _final_weights(
            tmp_path_factory.mktemp("plain"),
            "plain",
            "--model.activation_checkpointing",
            "none",
            "--model.fused_loss",
            "false",
        )


@pytest.mark.slow
@pytest.mark.parametrize("policy", RECOMPUTE_POLICIES)
def test_every_policy_with_the_fused_loss_trains_to_the_plain_paths_weights(policy, plain, tmp_path):
    trained = _final_weights(tmp_path, policy, "--model.activation_checkpointing", policy, "--model.fused_loss", "true")
    assert trained.keys() == plain.keys()
    for name, weight in plain.items():
        # float32: the chunked loss sums its softmax and gradients in another order (~1e-7 relative); three AdamW
        # steps at lr 3e-3 move each weight by ~1e-2, so a wrong gradient shows far above this bound.
        torch.testing.assert_close(trained[name], weight, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
def test_the_configs_recipe_with_the_feed_forward_over_chunks_trains_to_the_plain_paths_weights(plain, tmp_path):
    """keep_attention, the fused loss and the feed-forward over chunks of 12 positions (32 a window: 12, 12, 8)."""
    flags = ["--model.activation_checkpointing", "keep_attention", "--model.ffn_chunk_tokens", "12"]
    trained = _final_weights(tmp_path, "chunked", *flags)
    for name, weight in plain.items():
        torch.testing.assert_close(trained[name], weight, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
def test_synthetic_tokens_start_at_the_loss_of_knowing_nothing(tmp_path, capsys):
    main(
        [
            *EIGHT_B_SHAPED,
            "--trainer.default_root_dir",
            str(tmp_path),
            "--max_steps",
            "1",
            "--trainer.log_every_n_steps",
            "1",
        ]
    )
    out = capsys.readouterr().out
    loss = float(re.search(r"^loss +train (\d+\.\d+)", out, re.MULTILINE)[1])
    assert math.log(2374) - 0.05 < loss < math.log(2374) + 0.5  # uniform targets: ln V at best, on average
