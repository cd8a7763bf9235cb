"""The mixed-precision bench: accumulation results against float64 arithmetic, and autocast's dtypes."""

from __future__ import annotations

import csv

import pytest
import torch

from lm_systems.bench import mixed_precision
from lm_systems.bench.mixed_precision import accumulate


@pytest.mark.parametrize("accumulator, addend", [(torch.float32, torch.float32), (torch.float32, torch.float16)])
def test_fp32_accumulator_only_rounds_the_sum(accumulator, addend):
    # Reference: the addend as stored, summed in float64; an fp32 sum of 1000 terms stays within 1e-4 of it.
    stored = torch.tensor(0.01, dtype=addend).double().item()
    assert accumulate(accumulator, addend, cast_first=False) == pytest.approx(1000 * stored, abs=2e-4)


def test_fp16_accumulator_stalls_where_its_spacing_exceeds_the_addend():
    # Above 8 the fp16 spacing is 2^-7 = 0.0078: each +0.01 rounds to a multiple of it, so the sum drifts.
    result = accumulate(torch.float16, torch.float16, cast_first=False)
    assert 9.9 < result < 9.99
    # bf16 keeps 8 bits of mantissa: at 4 the spacing (2^-5 = 0.031) exceeds twice 0.01 and the sum stops.
    assert accumulate(torch.bfloat16, torch.bfloat16, cast_first=False) == 4.0


def test_casting_first_matches_adding_directly():
    direct = accumulate(torch.float32, torch.float16, cast_first=False)
    assert accumulate(torch.float32, torch.float16, cast_first=True) == direct


def test_command_writes_both_tables_with_autocast_dtypes(tmp_path):
    mixed_precision.main(["--device", "cpu", "--out-dir", str(tmp_path)])
    with open(tmp_path / "mixed_precision_accumulation.csv") as f:
        assert len(list(csv.DictReader(f))) == len(mixed_precision.VARIANTS)
    with open(tmp_path / "mixed_precision_autocast.csv") as f:
        dtypes = {(r["model"], r["tensor"]): r["dtype"] for r in csv.DictReader(f)}
    low = {"float16", "bfloat16"}
    assert dtypes[("ToyModel", "parameters")] == "float32"
    assert dtypes[("ToyModel", "fc1 output")] in low
    assert dtypes[("ToyModel", "model output (logits)")] in low
    assert dtypes[("ToyModel", "loss")] == "float32"  # cross_entropy runs in fp32 under autocast
    assert dtypes[("ToyModel", "gradients")] == "float32"
    # Our RMSNorm computes in fp32 and keeps its input's dtype; the residual adds promote back to fp32.
    assert dtypes[("TransformerLM", "block (residual stream) output")] == "float32"
    assert dtypes[("TransformerLM", "attention output")] in low
