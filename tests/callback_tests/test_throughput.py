"""MFUMonitor: tokens counted as B·T, MFU against the given peak, under names that say so; validation not logged."""

from __future__ import annotations

import csv

import lightning.pytorch as L
import pytest
import torch
from tiny_training import BATCH, CONFIG, RandomTokenLM, fit
from torch.utils.data import DataLoader

from callbacks import MFUMonitor

PEAK = 2.5e12  # any positive number: MFU must be the achieved FLOP/s over it


def _last_logged(metrics_csv, key: str) -> float:
    with open(metrics_csv) as f:
        values = [row[key] for row in csv.DictReader(f) if row.get(key)]
    assert values, f"{key} was never logged"
    return float(values[-1])


@pytest.mark.slow
def test_tokens_per_second_and_mfu(tmp_path):
    module = RandomTokenLM()
    trainer = fit(
        module,
        [MFUMonitor(window_size=3, peak_flops_per_s=PEAK)],
        tmp_path,
        max_steps=6,
        logger="csv",
        val_batches=4,
        val_check_interval=5,
    )
    metrics = f"{trainer.log_dir}/metrics.csv"
    tokens_per_s = _last_logged(metrics, "train/tokens_per_sec")
    flops_per_token = module.flops_per_batch / (BATCH * CONFIG.context_length)  # T tokens a window, not T + 1
    assert _last_logged(metrics, "train/mfu") == pytest.approx(tokens_per_s * flops_per_token / PEAK)
    with open(metrics) as f:
        columns = next(csv.reader(f))
    # Only the two: Lightning's others are these scaled or running counts; validation counts its own batches.
    assert sorted(c for c in columns if c.startswith(("train/", "validate/"))) == ["train/mfu", "train/tokens_per_sec"]


def test_no_mfu_without_a_peak(tmp_path):
    trainer = fit(RandomTokenLM(), [monitor := MFUMonitor(window_size=2)], tmp_path, max_steps=4, logger="csv")
    assert monitor.available_flops is None  # a CPU
    with open(f"{trainer.log_dir}/metrics.csv") as f:
        assert "train/mfu" not in next(csv.reader(f))


def test_window_size_is_checked():
    with pytest.raises(ValueError, match="window_size"):
        MFUMonitor(window_size=1)


class DictBatchLM(RandomTokenLM):
    """Takes {"tokens": (B, T + 1)} batches, which MFUMonitor cannot count."""

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch["tokens"], batch_idx)


def test_non_token_batches_are_refused(tmp_path):
    windows = [{"tokens": torch.randint(0, CONFIG.vocab_size, (CONFIG.context_length + 1,))} for _ in range(4)]
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=2,
        callbacks=[MFUMonitor()],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    with pytest.raises(TypeError, match=r"\(B, T \+ 1\) token batches"):
        trainer.fit(DictBatchLM(), DataLoader(windows, batch_size=2))
