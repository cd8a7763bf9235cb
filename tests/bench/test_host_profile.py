"""bench.host_profile: per-thread host time from profiler events, and a tiny run on two gloo ranks."""

import csv

import pytest

from lm_systems.bench import host_profile


def test_rows_per_thread_and_category_with_their_largest_entries():
    events = [
        {"ph": "X", "cat": "cuda_runtime", "tid": 7, "name": "cudaLaunchKernel", "dur": 10.0},
        {"ph": "X", "cat": "cuda_runtime", "tid": 7, "name": "cudaLaunchKernel", "dur": 14.0},
        {"ph": "X", "cat": "cuda_runtime", "tid": 7, "name": "cudaEventRecord", "dur": 3.0},
        {"ph": "X", "cat": "cuda_runtime", "tid": 9, "name": "cudaEventQuery", "dur": 1.0},
        {"ph": "X", "cat": "cpu_op", "tid": 7, "name": "aten::mm", "dur": 2500.0},
        {"ph": "X", "cat": "cpu_op", "tid": 9, "name": "aten::add", "dur": 5.0},  # under MIN_OPERATOR_MS
        {"ph": "X", "cat": "kernel", "tid": 1, "name": "gemm", "dur": 900.0},  # GPU side: not host time
        {"ph": "i", "cat": "cuda_runtime", "tid": 7, "name": "marker"},  # not a complete event
    ]
    rows = host_profile.summarize_host(events, "v", rank=1)
    got = {(r["thread"], r["category"]): r for r in rows}
    assert set(got) == {(7, "cpu_op"), (7, "cuda_runtime"), (9, "cuda_runtime")}
    launch = got[(7, "cuda_runtime")]
    assert launch["calls"] == 3 and launch["total_ms"] == pytest.approx(0.027)
    assert launch["largest"].startswith("cudaLaunchKernel 0.0 ms/2, cudaEventRecord")
    assert rows[0]["category"] == "cpu_op"  # the largest total first
    assert all(r["variant"] == "v" and r["rank"] == 1 for r in rows)


def test_tiny_run_on_two_gloo_ranks_reports_each_variant(tmp_path):
    host_profile.main(["--size", "tiny", "--vocab-size", "64", "--context-length", "16", "--batch-size", "1",
                       "--device", "cpu", "--nproc", "2", "--warmup", "1",
                       "--variants", "single,bucketed_1+thread", "--out-dir", str(tmp_path)])
    with open(tmp_path / "host_profile_tiny_2cpu.csv") as f:
        rows = list(csv.DictReader(f))
    ranks = {variant: {r["rank"] for r in rows if r["variant"] == variant} for variant in ("single", "bucketed_1+thread")}
    assert ranks == {"single": {"0"}, "bucketed_1+thread": {"0", "1"}}  # single runs on rank 0 alone
    assert all(float(r["total_ms"]) > 0 and int(r["calls"]) > 0 for r in rows)


def test_a_bad_variant_names_the_flag():
    with pytest.raises(SystemExit):
        host_profile.parse_args(["--device", "cpu", "--variants", "single,fastest"])
