"""`python train.py --strategy X --accelerator cpu --devices 2` for every strategy (Lightning's popen launcher
re-runs the script once per extra process, so this goes through a subprocess), and the example configs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lm_systems.cli import main

REPO = Path(__file__).resolve().parents[2]
TINY = ["--model.d_model", "32", "--model.num_layers", "1", "--model.num_heads", "2", "--model.d_ff", "64",
        "--model.context_length", "16", "--model.sample_prompt", "", "--data.generated_stories", "300",
        "--data.vocab_size", "300", "--data.batch_size", "2", "--data.val_batches", "1",
        "--trainer.val_check_interval", "2", "--trainer.enable_progress_bar", "false", "--trainer.logger", "false"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """Corpus and tokenizer built by the first run, reused by the others."""
    return tmp_path_factory.mktemp("data_cache")


@pytest.mark.parametrize("strategy", ["naive_ddp", "overlap_ddp", "bucketed_ddp", "zero1"])
def test_train_py_runs_on_two_cpu_processes(strategy, tmp_path, cache_dir):
    command = [sys.executable, str(REPO / "train.py"), "--strategy", strategy, "--accelerator", "cpu", "--devices",
               "2", "--max_steps", "3", *TINY, "--data.cache_dir", str(cache_dir)]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "`Trainer.fit` stopped: `max_steps=3` reached" in done.stdout + done.stderr
    (checkpoint,) = tmp_path.rglob("step=3.ckpt")
    saved = torch.load(checkpoint, weights_only=False)
    trainable = sum(1 for k in saved["state_dict"] if k.startswith("model."))
    (optimizer_state,) = saved["optimizer_states"]
    # zero1 too: one consolidated state with every parameter's AdamW moments.
    assert len(optimizer_state["state"]) == trainable


@pytest.mark.parametrize("config", sorted(p.name for p in (REPO / "configs" / "strategies").glob("*.yaml")))
def test_strategy_configs_parse(config, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["-c", str(REPO / "configs" / "strategies" / config), "--print_config"])
    assert exit_.value.code in (0, None)
    assert "class_path: strategies." in capsys.readouterr().out
