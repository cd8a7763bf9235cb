"""The dense peak-FLOP/s table that MFUMonitor and the model benchmark share: chip names and rates."""

import pytest
import torch

from lm_systems.profiling.hardware import PEAK_FLOPS, chip_name, peak_flops


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
