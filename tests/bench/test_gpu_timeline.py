"""The kernel-timeline arithmetic of lm_systems.bench.gpu_timeline on hand-made traces."""

import pytest

from lm_systems.bench.gpu_timeline import intersection, summarize_kernels, union


def test_union_merges_overlapping_and_touching_intervals():
    assert union([(5, 7), (0, 2), (1, 3), (3, 4), (10, 11)]) == [(0, 4), (5, 7), (10, 11)]


def test_intersection_of_two_disjoint_lists():
    assert intersection([(0, 4), (6, 10)], [(2, 7), (9, 12)]) == pytest.approx(2 + 1 + 1)
    assert intersection([(0, 1)], [(1, 2)]) == 0


def test_summary_splits_communication_hidden_under_compute_from_exposed_and_idle():
    # compute 0-1000 µs and 1500-2000 µs; NCCL 800-1800 µs: 200 + 300 µs of it under compute.
    kernels = [("ampere_sgemm", 0, 1000), ("ncclDevKernel_AllReduce_Sum_f32", 800, 1000),
               ("vectorized_elementwise", 1500, 500)]
    s = summarize_kernels(kernels)
    assert s["gpu_span_ms"] == pytest.approx(2.0)
    assert s["compute_ms"] == pytest.approx(1.5)
    assert s["comm_ms"] == pytest.approx(1.0)
    assert s["comm_hidden_frac"] == pytest.approx(0.5)
    assert s["comm_exposed_ms"] == pytest.approx(0.5)
    assert s["gpu_idle_ms"] == pytest.approx(0.0)


def test_idle_gaps_count_time_no_kernel_ran():
    s = summarize_kernels([("a", 0, 100), ("b", 400, 100)])
    assert s["gpu_idle_ms"] == pytest.approx(0.3)
    assert s["comm_ms"] == 0
