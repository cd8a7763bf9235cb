"""Peak dense FLOP/s of the GPUs we measure on: the denominator of every MFU figure in the project.

Shared by ``callbacks.MFUMonitor`` and ``python -m benchmarks.model`` so both report the same MFU.
Lightning's own table (``lightning.fabric.utilities.throughput``) lists the H200's tensor-core rates
*with* 2:4 sparsity (2.0e15 bf16), which would halve every MFU on that chip; these are the dense rates.
"""

from __future__ import annotations

import torch

_TF32 = "tf32"

# Dense datasheet rates. fp32 without TF32 runs on the CUDA cores; with TF32 on the tensor cores.
PEAK_FLOPS: dict[str, dict[torch.dtype | str, float]] = {
    "h100 sxm": {torch.float32: 66.9e12, _TF32: 494.7e12, torch.bfloat16: 989.4e12, torch.float16: 989.4e12},
    "h100 pcie": {torch.float32: 51.2e12, _TF32: 378e12, torch.bfloat16: 756e12, torch.float16: 756e12},
    "h100 nvl": {torch.float32: 60e12, _TF32: 417.5e12, torch.bfloat16: 835.5e12, torch.float16: 835.5e12},
    "h200 sxm": {torch.float32: 66.9e12, _TF32: 494.7e12, torch.bfloat16: 989.4e12, torch.float16: 989.4e12},
    "h200 nvl": {torch.float32: 60e12, _TF32: 417.5e12, torch.bfloat16: 835.5e12, torch.float16: 835.5e12},
    "a100": {torch.float32: 19.5e12, _TF32: 156e12, torch.bfloat16: 312e12, torch.float16: 312e12},
}


def chip_name(device_name: str) -> str | None:
    """Key of ``PEAK_FLOPS`` for a CUDA device name such as "NVIDIA H100 80GB HBM3", or None if unknown."""
    name = device_name.lower()
    for family in ("h100", "h200"):
        if family in name:
            if "nvl" in name:
                return f"{family} nvl"
            if "pcie" in name:
                return f"{family} pcie" if family == "h100" else None
            return f"{family} sxm"
    return "a100" if "a100" in name else None


def peak_flops(device: torch.device | str, dtype: torch.dtype) -> float | None:
    """Dense peak FLOP/s of ``device`` for matmuls in ``dtype``; None on CPU or an unknown GPU.

    For float32 the rate follows ``torch.get_float32_matmul_precision()``: "highest" (PyTorch's
    default) keeps fp32 matmuls off the tensor cores; "high"/"medium" allow TF32.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return None
    chip = chip_name(torch.cuda.get_device_name(device))
    if chip is None:
        return None
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return PEAK_FLOPS[chip][_TF32]
    return PEAK_FLOPS[chip].get(dtype)
