"""The model benchmark at tiny sizes on the CPU: what it reports, OOM rows, argument checks."""

from __future__ import annotations

import csv

import pytest
import torch

from benchmarks import model as bench
from lm_systems.model.config import MODEL_SIZES

# The tiny size with a small vocabulary and context keeps each step to milliseconds on two cores.
FAST = ["--sizes", "tiny", "--vocab-size", "37", "--context-lengths", "9", "--steps", "2", "--warmup-steps", "1"]


def _rows(path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_every_mode_and_precision_gets_a_consistent_row(tmp_path):
    rows = bench.main([*FAST, "--device", "cpu", "--modes", *bench.MODES, "--out-dir", str(tmp_path), "--name", "t"])
    assert [(r["mode"], r["precision"]) for r in rows] == [(m, p) for p in ("fp32", "bf16") for m in bench.MODES]
    d_model = MODEL_SIZES["tiny"].d_model
    for row in rows:
        assert row["status"] == "ok" and row["attention"] == "sdpa"  # auto resolves to sdpa on the CPU
        assert 0 < row["std_ms"] <= row["max_ms"] and row["mean_ms"] <= row["max_ms"]
        assert row["tokens_per_s"] == pytest.approx(4 * 9 / (row["mean_ms"] / 1e3))
        assert row["residual_MiB"] * 2**20 == 4 * 9 * d_model * 4  # B × T × d_model × fp32 bytes
    assert len(_rows(tmp_path / "t.csv")) == len(rows)
    assert (tmp_path / "t.md").is_file() and (tmp_path / "t.png").stat().st_size > 0


def _case(mode: str, precision: str = "fp32") -> bench.Case:
    return bench.Case("tiny", 9, mode, precision, "naive", False, warmup=0, steps=1, batch_size=2, vocab_size=37)


@pytest.mark.slow
def test_modes_do_what_they_say():
    model = bench.build_model("tiny", 9, "naive", 37, torch.device("cpu"))
    before = [p.detach().clone() for p in model.parameters()]
    for mode in ("forward", "forward_backward"):
        bench.measure(model, _case(mode), torch.device("cpu"))
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True)), mode
        assert all(p.grad is None for p in model.parameters())
    bench.measure(model, _case("train_step"), torch.device("cpu"))
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


@pytest.mark.slow
def test_mfu_uses_the_shared_peak_table(monkeypatch):
    monkeypatch.setattr(bench, "peak_flops", lambda device, dtype: 1e9 if dtype == torch.bfloat16 else 2e9)
    model = bench.build_model("tiny", 9, "naive", 37, torch.device("cpu"))
    # A forward pass does a third of a training step's FLOPs (2N of 6N per token); batch 2, context 9.
    for mode, precision, peak, share in [("forward", "bf16", 1e9, 1 / 3), ("train_step", "fp32", 2e9, 1.0)]:
        row = bench.measure(model, _case(mode, precision), torch.device("cpu"))
        flops = model.flops_per_token(9) * 2 * 9 * share
        assert row["mfu"] == pytest.approx(flops / (row["mean_ms"] / 1e3) / peak)


@pytest.mark.slow
@pytest.mark.parametrize(
    "failure, status",
    [
        (torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)"), "OOM"),
        (RuntimeError("boom"), "error: RuntimeError"),
    ],
)
def test_a_failing_case_is_a_row_and_the_sweep_goes_on(failure, status, tmp_path, monkeypatch):
    real_measure = bench.measure

    def measure_that_fails(model, case, device):
        if case.mode == "forward":
            raise failure
        return real_measure(model, case, device)

    monkeypatch.setattr(bench, "measure", measure_that_fails)
    rows = bench.main([*FAST, "--device", "cpu", "--precisions", "fp32", "--out-dir", str(tmp_path)])
    assert [r["status"] for r in rows] == [status, "ok"]
    assert status in (tmp_path / "model_benchmark.md").read_text()


@pytest.mark.slow
def test_isolated_cases_run_in_fresh_processes(tmp_path):
    rows = bench.main(
        [
            *FAST,
            "--device",
            "cpu",
            "--modes",
            "forward",
            "--precisions",
            "fp32",
            "--warmup-steps",
            "0",
            "--isolate",
            "--out-dir",
            str(tmp_path),
        ]
    )
    assert len(rows) == 1 and rows[0]["status"] == "ok" and rows[0]["warmup"] == 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "0"], "--steps"),
        (["--sizes", "huge"], "invalid choice: 'huge'"),
        (["--attention", "nope"], "invalid choice: 'nope'"),
        (["--device", "tpu"], "choose cuda or cpu, got 'tpu'"),
    ],
)
def test_bad_arguments_name_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_peak_memory_grows_from_forward_to_the_training_step(tmp_path):
    rows = bench.main([*FAST, "--modes", "forward", "train_step", "--precisions", "bf16", "--out-dir", str(tmp_path)])
    forward, train = rows
    assert 0 < forward["peak_mem_GiB"] < train["peak_mem_GiB"]
