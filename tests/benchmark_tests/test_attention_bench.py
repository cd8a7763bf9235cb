"""The attention bench: its FLOP count against a counted causal mask, and (on a GPU) its flash sweep at tiny sizes."""

from __future__ import annotations

import argparse
import csv
import os

import pytest
import torch

from benchmarks import attention as bench
from benchmarks import attention_clocks, attention_ncu


@pytest.mark.parametrize("n_q, n_k", [(1, 1), (4, 4), (3, 7), (16, 64), (13, 13)])
def test_flops_count_the_pairs_an_end_aligned_causal_mask_keeps(n_q, n_k):
    kept = int(torch.ones(n_q, n_k).tril(diagonal=n_k - n_q).sum())  # query i sees keys j <= i + n_k - n_q
    flops = bench.attention_flops(batch_heads=3, n_q=n_q, n_k=n_k, d=8)
    assert flops["fwd"] == 4 * 8 * kept * 3  # QKᵀ and PV: 2·d multiply-adds each per kept pair
    assert flops["bwd"] == 2.5 * flops["fwd"] and flops["fwd+bwd"] == 3.5 * flops["fwd"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_without_a_gpu_the_bench_says_so():
    with pytest.raises(SystemExit, match="needs a GPU"):
        bench.main(["--mode", "flash"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_without_a_gpu_the_ncu_backward_says_so(capsys):
    with pytest.raises(SystemExit) as exit_:
        attention_ncu.main(["--impl", "flash_triton"])
    assert exit_.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err


def test_the_profiled_backward_is_one_backward_not_an_accumulation(monkeypatch):
    """The callable runs the backward again with the inputs' gradients dropped: each call's gradients are one
    backward's, and nothing adds a previous call's to them (the profile would show the adds)."""
    leaves = []

    def attend(q, k, v, is_causal):
        leaves[:] = [q, k, v]
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal)

    monkeypatch.setattr(attention_ncu, "implementations", lambda names: {names[0]: attend})
    monkeypatch.setattr(attention_ncu, "_qkv", lambda *shape: _cpu_qkv(*shape))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    args = argparse.Namespace(batch=1, heads=2, seq=8, head_dim=4)
    backward = attention_ncu.causal_backward("flash_triton", args)
    once = [t.grad.clone() for t in leaves]
    backward()
    backward()
    for grad, leaf in zip(once, leaves, strict=True):
        torch.testing.assert_close(leaf.grad, grad)


def _cpu_qkv(batch, heads, n_q, n_k, d, dtype):
    make = lambda n: torch.randn(batch, heads, n, d, dtype=torch.float64, requires_grad=True)  # noqa: E731
    return make(n_q), make(n_k), make(n_k)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_without_a_gpu_the_clock_bench_says_so(capsys):
    with pytest.raises(SystemExit) as exit_:
        attention_clocks.main([])
    assert exit_.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err


def test_clock_summary_takes_medians_and_counts_cycles_against_the_baseline():
    def row(impl, mode, ms, mhz):
        return {"impl": impl, "mode": mode, "ms": ms, "sm_mhz": mhz, "watts": 600.0}

    rows = [row("ours", "hot", ms, 1800) for ms in (10.0, 11.0, 30.0)]  # median 11, the 30 an outlier
    rows += [row("theirs", "hot", ms, 1650) for ms in (10.0, 10.0, 12.0)]  # median 10
    rows += [row("ours", "cold", 9.0, 2000), row("theirs", "cold", 9.0, 1000)]
    by = {(r["mode"], r["impl"]): r for r in attention_clocks.summary(rows, baseline="theirs")}
    assert by["hot", "ours"]["ms"] == 11.0 and by["hot", "theirs"]["time_ratio"] == 1.0
    assert by["hot", "ours"]["time_ratio"] == pytest.approx(10 / 11)
    assert by["hot", "ours"]["cycles_ratio"] == pytest.approx(10 * 1650 / (11 * 1800))
    assert by["cold", "ours"]["time_ratio"] == 1.0 and by["cold", "ours"]["cycles_ratio"] == 0.5


def _rows(path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.gpu
def test_gpu_flash_sweep_at_tiny_sizes(tmp_path):
    bench.main(
        [
            "--mode",
            "flash",
            "--flash-seq-lens",
            "128",
            "--flash-head-dims",
            "16",
            "--flash-dtypes",
            "fp32",
            "--rep-ms",
            "5",
            "--out-dir",
            str(tmp_path),
        ]
    )
    rows = _rows(tmp_path / "attention_flash_sweep.csv")
    assert [(r["impl"], r["N_q"]) for r in rows] == [(i, n) for n in ("128", "32") for i in bench.FLASH_IMPLS]
    for row in rows:
        if row["fwd+bwd_TFLOPs"]:
            flops = bench.attention_flops(1, int(row["N_q"]), 128, 16)["fwd+bwd"]
            assert float(row["fwd+bwd_TFLOPs"]) == pytest.approx(flops / float(row["fwd+bwd_ms"]) / 1e9)
    assert (tmp_path / "attention_flash_sweep.png").exists()


def test_a_headline_implementation_s_environment_is_set_for_its_timing_and_restored_after(monkeypatch):
    monkeypatch.delenv("LM_SYSTEMS_FLASH_HOPPER", raising=False)
    monkeypatch.setenv("LM_SYSTEMS_FLASH_TMA", "1")
    with bench.headline_environment("flash_triton_portable"):
        assert (os.environ["LM_SYSTEMS_FLASH_HOPPER"], os.environ["LM_SYSTEMS_FLASH_TMA"]) == ("0", "1")
    assert "LM_SYSTEMS_FLASH_HOPPER" not in os.environ and os.environ["LM_SYSTEMS_FLASH_TMA"] == "1"
    with bench.headline_environment("flash_triton"):
        assert "LM_SYSTEMS_FLASH_HOPPER" not in os.environ
    assert bench.HEADLINE_ENV["flash_triton_portable"] == {"LM_SYSTEMS_FLASH_HOPPER": "0"}
