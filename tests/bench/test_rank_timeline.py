"""The two-rank timeline arithmetic of lm_systems.bench.rank_timeline on hand-made traces."""

import pytest

from lm_systems.bench.rank_timeline import align, collectives, pair_collectives, read_events, summarize_rank, turn_rows


def test_pairing_waits_joint_time_and_queueing():
    rank0 = [(0.0, 50.0), (55.0, 120.0)]   # in first both times; its second started right after its first
    rank1 = [(30.0, 50.0), (100.0, 120.0)]  # joined 30 and 45 µs later
    stats = pair_collectives([rank0, rank1])
    assert stats[0] == {"waited_us": pytest.approx(30 + 45), "joint_us": pytest.approx(20 + 20), "queued": 1}
    assert stats[1] == {"waited_us": pytest.approx(0), "joint_us": pytest.approx(20 + 20), "queued": 0}


def test_ranks_with_different_collective_counts_are_refused():
    with pytest.raises(ValueError, match="different numbers"):
        pair_collectives([[(0.0, 1.0)], []])


def test_align_puts_zero_at_the_opening_all_reduce_end_and_drops_it():
    trace = [{"cat": "kernel", "name": "ncclDevKernel_AllReduce", "ts": 1000.0, "dur": 10.0},
             {"cat": "kernel", "name": "sm90_gemm", "ts": 1020.0, "dur": 5.0},
             {"cat": "gpu_memcpy", "name": "Memcpy PtoP", "ts": 1030.0, "dur": 2.0},
             {"cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 1.0}]
    events = align(read_events(trace))
    assert events == [("sm90_gemm", 10.0, 5.0, False), ("Memcpy PtoP", 20.0, 2.0, True)]
    with pytest.raises(ValueError, match="no NCCL kernel"):
        align(read_events(trace[1:]))


def test_rank_summary_separates_compute_matmuls_communication_and_idle():
    events = [("sm90_gemm_bf16", 0.0, 400.0, False), ("elementwise", 400.0, 100.0, False),
              ("ncclDevKernel", 300.0, 400.0, True), ("elementwise", 900.0, 100.0, False)]
    s = summarize_rank(events)
    assert s["span_ms"] == pytest.approx(1.0)
    assert s["compute_ms"] == pytest.approx(0.6)
    assert s["gemm_ms"] == pytest.approx(0.4)
    assert s["comm_ms"] == pytest.approx(0.4)
    assert s["comm_under_compute_ms"] == pytest.approx(0.2)
    assert s["idle_ms"] == pytest.approx(0.2)


def test_turn_rows_are_per_step_and_skip_a_rank_that_did_not_step():
    host = {"forward": [0.01], "backward": [0.02], "sync": [0.003], "step": [0.04]}
    busy = [("gemm", 0.0, 2000.0, False), ("nccl_a", 100.0, 100.0, True), ("nccl_b", 1000.0, 100.0, True)]
    rows = turn_rows("bucketed_25", 0, [{"events": busy, "host": host}, {"events": busy, "host": host}], steps=2)
    assert [r["rank"] for r in rows] == [0, 1]
    assert rows[0]["span_ms"] == pytest.approx(1.0) and rows[0]["collectives"] == 1
    assert rows[0]["wait_ms"] == 0 and rows[0]["host_backward_ms"] == pytest.approx(20.0)
    single = turn_rows("single", 0, [{"events": busy, "host": host}, {"events": [], "host": host}], steps=1)
    assert [r["rank"] for r in single] == [0] and "wait_ms" not in single[0]
    assert len(collectives(busy)) == 2
