"""The fused-loss bench at tiny sizes on the CPU: a row per variant and chunk, the losses agree, OOM rows."""

from __future__ import annotations

import csv

import pytest
import torch

from benchmarks import loss as bench
from lm_systems.model.loss import default_chunk_tokens

# Tiny sizes, one timed step: milliseconds a variant on two cores (the compiled ones compile once each).
FAST = [
    "--device",
    "cpu",
    "--tokens",
    "48",
    "--vocab",
    "300",
    "--d-model",
    "32",
    "--dtype",
    "fp32",
    "--warmup",
    "1",
    "--reps",
    "1",
]


@pytest.mark.slow  # torch.compiles two of the variants
def test_every_variant_and_chunk_gets_a_row_and_they_agree_on_the_loss(tmp_path):
    rows = bench.main([*FAST, "--chunk-tokens", "16", "--out-dir", str(tmp_path), "--name", "t"])
    assert default_chunk_tokens(300) > 48  # the default chunk is the whole step: measured as 48
    assert [(r["variant"], r["chunk_tokens"]) for r in rows] == [
        ("plain", ""),
        ("plain_compiled", ""),
        ("fused_triton", 48),  # interpreted
        ("fused_triton", 16),
        ("fused_compiled", 48),
        ("fused_compiled", 16),
        ("fused_eager", 48),
        ("fused_eager", 16),
    ]
    plain = rows[0]["loss"]
    for row in rows:
        assert row["status"] == "ok" and row["tokens"] == 48 and 0 < row["min_ms"] <= row["median_ms"]
        # float32 everywhere: the variants differ only in the order of their sums, 1e-5 relative is loose for that.
        assert row["loss"] == pytest.approx(plain, rel=1e-5)
        assert row["vs_plain"] == pytest.approx(rows[0]["median_ms"] / row["median_ms"])
    with open(tmp_path / "t.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    assert "chunk_tokens" in (tmp_path / "t.md").read_text()


def test_a_variant_that_runs_out_of_memory_is_a_row_and_the_rest_still_run(tmp_path, monkeypatch):
    def out_of_memory(hidden, weight, targets):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setitem(bench.VARIANTS, "plain", lambda chunk: out_of_memory)
    rows = bench.main([*FAST, "--chunk-tokens", "--variants", "plain", "fused_eager", "--out-dir", str(tmp_path)])
    assert [(r["variant"], r["status"], r["vs_plain"]) for r in rows] == [
        ("plain", "OOM", ""),
        ("fused_eager", "ok", ""),
    ]
    assert "OOM" in (tmp_path / "fused_loss.md").read_text()
