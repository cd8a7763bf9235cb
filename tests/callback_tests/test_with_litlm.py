"""Every profiling callback together on the project's own LitLM and LMDataModule (configs/profiling.yaml's
use through train.py is in tests/test_cli.py)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import lightning.pytorch as L
import pytest
from lightning.pytorch.loggers import CSVLogger

from callbacks import MemorySnapshot, MFUMonitor, NVTXRanges, StepTimer
from lm_systems.data.datamodule import LMDataModule
from lm_systems.lit_module import LitLM

# A model and corpus small enough that data preparation and 8 steps take seconds on two cores.
SMALL_MODEL = {"size": "tiny", "d_model": 32, "num_layers": 2, "num_heads": 2, "d_ff": 64, "sample_prompt": ""}
SMALL_DATA = {"generated_stories": 200, "vocab_size": 280, "batch_size": 2, "val_batches": 2}


@pytest.mark.slow
def test_litlm_trains_with_every_profiling_callback(tmp_path):
    L.seed_everything(7)
    data = LMDataModule(context_length=24, cache_dir=str(tmp_path / "data"), **SMALL_DATA)
    module = LitLM(context_length=24, warmup_steps=2, **SMALL_MODEL)
    timer = StepTimer(warmup_steps=2, timed_steps=4)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=8,
        logger=CSVLogger(tmp_path, name="run"),
        log_every_n_steps=1,
        callbacks=[timer, MFUMonitor(window_size=3, peak_flops_per_s=1e12), MemorySnapshot(), NVTXRanges()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    with pytest.warns(UserWarning, match="MemorySnapshot needs a CUDA device"):
        trainer.fit(module, datamodule=data)
    assert trainer.global_step == 8

    summary = json.loads(Path(trainer.log_dir, "step_times_rank0.json").read_text())
    phases = summary["phases"]
    assert phases["step"]["steps"] == 4
    parts = phases["forward"]["mean_ms"] + phases["backward"]["mean_ms"] + phases["optimizer"]["mean_ms"]
    assert 0 < parts <= phases["step"]["mean_ms"]

    with open(Path(trainer.log_dir, "metrics.csv")) as f:
        logged = [row for row in csv.DictReader(f) if row.get("train/mfu")]
    assert logged, "MFU was never logged"
    tokens_per_s, mfu = float(logged[-1]["train/tokens_per_sec"]), float(logged[-1]["train/mfu"])
    flops_per_token = module.flops_per_batch / (2 * 24)  # LitLM's flops_per_batch: flops_per_token × B × T
    assert mfu == pytest.approx(tokens_per_s * flops_per_token / 1e12)
