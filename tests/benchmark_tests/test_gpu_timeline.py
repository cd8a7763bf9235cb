import gzip
import json
import math

import pytest

from benchmarks import gpu_timeline


def span(cat: str, name: str, start: float, end: float) -> dict:
    """A complete trace event, times in microseconds as torch.profiler writes them."""
    return {"ph": "X", "cat": cat, "name": name, "ts": start, "dur": end - start}


# Two steps in a 4,000 µs window. Compute: 0-1000 and 500-1500 on two streams (1,500 µs of union) and 3000-3500.
# NCCL: 1200-2200 (300 µs beside compute, 700 exposed). A copy at 2500-2600. Idle: 1,200 µs of the 4,000.
# The host: two launches, one synchronize of 400 µs, an asynchronous copy (not a wait), a CPU op.
EVENTS = [
    span("kernel", "ampere_bf16_gemm", 0, 1000),
    span("kernel", "triton_poi_fused_add", 500, 1500),
    span("kernel", "ncclDevKernel_AllReduce_Sum_f32", 1200, 2200),
    span("gpu_memcpy", "Memcpy DtoH", 2500, 2600),
    span("kernel", "vectorized_elementwise_kernel", 3000, 3500),
    span("cuda_runtime", "cudaLaunchKernel", 0, 5),
    span("cuda_runtime", "cudaLaunchKernelExC", 10, 15),
    span("cuda_runtime", "cudaStreamSynchronize", 3600, 4000),
    span("cuda_runtime", "cudaMemcpyAsync", 2400, 2450),
    span("cpu_op", "aten::add", 100, 120),
    {"ph": "i", "name": "an instant, no duration", "ts": 9000},
]


def test_a_window_divides_into_compute_link_idle_and_host_waits():
    row = gpu_timeline.summarize(EVENTS, steps=2)
    assert row["traced_ms_per_step"] == pytest.approx(4.000 / 2)
    assert row["compute_ms"] == pytest.approx(2.000 / 2)  # 0-1500 and 3000-3500: two streams at once count once
    assert row["nccl_ms"] == pytest.approx(1.000 / 2)
    assert row["nccl_exposed_ms"] == pytest.approx(0.700 / 2)  # 1500-2200: no compute beside it
    assert row["gpu_idle_ms"] == pytest.approx((4.000 - 2.200 - 0.100 - 0.500) / 2)  # busy: 0-2200, copy, 3000-3500
    assert row["host_sync_ms"] == pytest.approx(0.400 / 2)
    assert row["launches"] == 1


def test_exposed_nccl_time_is_told_apart_by_collective():
    events = [
        span("kernel", "sm90_xmma_gemm_bf16", 0, 1000),
        span("kernel", "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 800, 1300),
        span("kernel", "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 1300, 1500),
        span("kernel", "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 1500, 1600),
    ]
    row = gpu_timeline.summarize(events, steps=1)
    assert row["exposed_all_gather_ms"] == pytest.approx(0.300)  # 1000-1300: 200 µs of it ran beside the gemm
    assert row["exposed_reduce_scatter_ms"] == pytest.approx(0.200)
    assert row["exposed_all_reduce_ms"] == 0
    assert row["nccl_exposed_ms"] == pytest.approx(0.600)  # the send/recv counts in the total alone


def test_a_trace_without_gpu_or_runtime_events_reads_not_a_number_not_zero():
    row = gpu_timeline.summarize([span("cpu_op", "aten::mm", 0, 2000)], steps=1)
    assert row["traced_ms_per_step"] == pytest.approx(2.0)
    assert all(math.isnan(row[column]) for column in gpu_timeline.COLUMNS[1:])


def test_nothing_to_read_is_an_error_that_says_so():
    with pytest.raises(ValueError, match="no complete events"):
        gpu_timeline.summarize([{"ph": "i", "ts": 0}], steps=1)
    with pytest.raises(ValueError, match="steps must be at least 1"):
        gpu_timeline.summarize(EVENTS, steps=0)


def test_a_gzipped_trace_reads_as_its_json(tmp_path):
    trace = tmp_path / "trace_rank0.json.gz"
    trace.write_bytes(gzip.compress(json.dumps({"traceEvents": EVENTS}).encode()))
    assert gpu_timeline.summarize_file(trace, steps=2) == gpu_timeline.summarize(EVENTS, steps=2)


def test_the_command_prints_a_row_per_trace(tmp_path, capsys):
    trace = tmp_path / "rank0.trace.json"
    trace.write_text(json.dumps({"traceEvents": EVENTS}))
    gpu_timeline.main([str(trace), "--steps", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split(" | ")[1:3] == ["traced_ms_per_step", "compute_ms"]
    assert lines[2].startswith("| rank0.trace.json | 2.0 | 1.0 | 0.5 |") and lines[2].endswith("| 0.6 | 0.2 | 1.0 |")
