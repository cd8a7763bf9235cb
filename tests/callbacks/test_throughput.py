"""MFUMonitor: tokens counted as B·T, MFU against the given peak, evaluation counted as forward only."""

from __future__ import annotations

import csv

import lightning.pytorch as L
import pytest
import torch
from torch.utils.data import DataLoader

from callbacks import MFUMonitor
from tiny_training import BATCH, CONFIG, RandomTokenLM, fit

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
        module, [MFUMonitor(window_size=3, peak_flops_per_s=PEAK)], tmp_path, max_steps=6, logger="csv",
        val_batches=4, val_check_interval=5,
    )
    metrics = f"{trainer.log_dir}/metrics.csv"
    tokens_per_s = _last_logged(metrics, "train/device/items_per_sec")
    samples_per_s = _last_logged(metrics, "train/device/samples_per_sec")
    flops_per_s = _last_logged(metrics, "train/device/flops_per_sec")
    assert tokens_per_s == pytest.approx(samples_per_s * CONFIG.context_length)  # T tokens, not T + 1
    flops_per_token = module.flops_per_batch / (BATCH * CONFIG.context_length)
    assert flops_per_s / tokens_per_s == pytest.approx(flops_per_token)
    assert _last_logged(metrics, "train/device/mfu") == pytest.approx(flops_per_s / PEAK)

    val_tokens_per_s = _last_logged(metrics, "validate/device/items_per_sec")
    val_flops_per_s = _last_logged(metrics, "validate/device/flops_per_sec")
    assert val_flops_per_s / val_tokens_per_s == pytest.approx(flops_per_token / 3)  # forward only


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
        accelerator="cpu", max_steps=2, callbacks=[MFUMonitor()], logger=False, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False, default_root_dir=tmp_path,
    )
    with pytest.raises(TypeError, match=r"\(B, T \+ 1\) token batches"):
        trainer.fit(DictBatchLM(), DataLoader(windows, batch_size=2))
