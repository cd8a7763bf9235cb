"""MFUMonitor: tokens counted as B·T, MFU against the given peak, evaluation counted as forward only;
and the dense peak-FLOP/s table it shares with the model benchmark."""

from __future__ import annotations

import csv

import lightning.pytorch as L
import pytest
import torch
from torch.utils.data import DataLoader

from callbacks import MFUMonitor
from lm_systems.hardware import PEAK_FLOPS, chip_name, peak_flops
from tests.callbacks.tiny_training import BATCH, CONFIG, RandomTokenLM, fit

PEAK = 2.5e12  # any positive number: MFU must be the achieved FLOP/s over it


def _last_logged(metrics_csv, key: str) -> float:
    with open(metrics_csv) as f:
        values = [row[key] for row in csv.DictReader(f) if row.get(key)]
    assert values, f"{key} was never logged"
    return float(values[-1])


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


@pytest.mark.parametrize(
    "device_name, chip",
    [
        ("NVIDIA H100 80GB HBM3", "h100 sxm"),
        ("NVIDIA H100 PCIe", "h100 pcie"),
        ("NVIDIA H100 NVL", "h100 nvl"),
        ("NVIDIA H200", "h200 sxm"),
        ("NVIDIA H200 NVL", "h200 nvl"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("Tesla T4", None),
    ],
)
def test_device_names_map_to_chips(device_name, chip):
    assert chip_name(device_name) == chip


def test_peak_is_dense_and_follows_matmul_precision(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    cuda = torch.device("cuda")
    assert peak_flops(cuda, torch.bfloat16) == pytest.approx(989.4e12)  # not the 2:4-sparse 1979
    assert peak_flops(cuda, torch.float32) == pytest.approx(66.9e12)
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert peak_flops(cuda, torch.float32) == pytest.approx(494.7e12)  # TF32 on the tensor cores
    assert peak_flops("cpu", torch.bfloat16) is None
    for rates in PEAK_FLOPS.values():  # tensor cores: bf16 = fp16 = 2 × TF32, far above plain fp32
        assert rates[torch.bfloat16] == rates[torch.float16] == pytest.approx(2 * rates["tf32"], rel=1e-3)
        assert rates[torch.float32] < rates["tf32"] / 5
