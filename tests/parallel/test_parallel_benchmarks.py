"""The communication and data-parallel benchmarks run end to end on the CPU (gloo, two processes, tiny sizes)."""

import csv

import pytest

from lm_systems.bench import comm, ddp


def test_comm_bench_reports_bus_bandwidth(tmp_path):
    rows = comm.main(["--backend", "gloo", "--nproc", "2", "--sizes-mb", "0.01,0.1", "--iters", "2",
                      "--warmup", "1", "--out-dir", str(tmp_path)])
    assert [r["size_mb"] for r in rows] == [0.01, 0.1]
    for row in rows:
        # Two ranks: bus bandwidth equals algorithm bandwidth, 2(n-1)/n = 1.
        assert row["busbw_GBps"] > 0 and abs(row["busbw_GBps"] - row["algbw_GBps"]) < 1e-12
        assert abs(row["algbw_GBps"] - row["size_mb"] * 1e6 / (row["time_ms"] * 1e-3) / 1e9) < 1e-9
    assert {p.name for p in tmp_path.iterdir()} == {f"comm_gloo_2proc.{ext}" for ext in ("csv", "md", "png")}


def test_comm_bench_all_reduces_in_chunks_and_names_bad_options(tmp_path):
    rows = comm.main(["--backend", "gloo", "--nproc", "2", "--sizes-mb", "0.1", "--chunk-mb", "0.03", "--iters", "2",
                      "--warmup", "1", "--out-dir", str(tmp_path)])
    assert [(r["size_mb"], r["chunk_mb"]) for r in rows] == [(0.1, 0.03)] and rows[0]["time_ms"] > 0
    for bad in (["--ops", "copy_engine"], ["--ops", "avg"], ["--chunk-mb", "0"]):
        with pytest.raises(SystemExit):
            comm.parse_args(["--backend", "gloo", *bad])


def test_ddp_bench_compares_variants_and_keeps_replicas_equal(tmp_path):
    ddp.main(["--size", "tiny", "--vocab-size", "64", "--context-length", "16", "--batch-size", "1", "--device",
              "cpu", "--nproc", "2", "--steps", "1", "--warmup", "1", "--instrumented-steps", "1", "--rounds", "1",
              "--variants", "single,torch_ddp,bucketed_1,zero1,bucketed_1+hp+bf16,bucketed_1+ostep3",
              "--out-dir", str(tmp_path)])
    with open(tmp_path / "ddp_tiny_2cpu.csv") as f:
        summary = {row["variant"]: row for row in csv.DictReader(f)}
    assert list(summary) == ["single", "torch_ddp", "bucketed_1", "zero1", "bucketed_1+hp+bf16", "bucketed_1+ostep3"]
    assert all(row["replicas_equal"] == "True" for row in summary.values())
    assert float(summary["torch_ddp"]["vs_torch_ddp"]) == 1.0
    # ZeRO-1 keeps half of AdamW's state per rank on two ranks.
    full, sharded = float(summary["bucketed_1"]["opt_state_GB"]), float(summary["zero1"]["opt_state_GB"])
    assert 0.4 * full < sharded < 0.6 * full
    assert (tmp_path / "ddp_tiny_2cpu.png").exists() and (tmp_path / "ddp_tiny_2cpu_rounds.csv").exists()


def test_local_variants_run_the_containers_but_send_no_gradient(tmp_path):
    # Ranks train on different data: with nothing sent, their replicas drift apart after one step.
    ddp.main(["--size", "tiny", "--vocab-size", "64", "--context-length", "16", "--batch-size", "1", "--device",
              "cpu", "--nproc", "2", "--steps", "1", "--warmup", "1", "--instrumented-steps", "0", "--rounds", "1",
              "--variants", "torch_ddp+local,bucketed_1+thread+local,bucketed_1+thread", "--out-dir", str(tmp_path)])
    with open(tmp_path / "ddp_tiny_2cpu.csv") as f:
        equal = {row["variant"]: row["replicas_equal"] for row in csv.DictReader(f)}
    assert equal == {"torch_ddp+local": "False", "bucketed_1+thread+local": "False", "bucketed_1+thread": "True"}


def test_ddp_bench_names_a_bad_variant_or_option():
    for bad, said in (("bucketed_x", "unknown variant 'bucketed_x'"), ("torch_ddp+fast", "unknown option 'fast'"),
                      ("single+bf16", "takes no communication options"), ("torch_ddp+thread", "not 'torch_ddp'"),
                      ("bucketed_25+stages2", "not 'bucketed_25'"), ("zero1+stages0", "unknown option 'stages0'"),
                      ("no_comm+hp", "takes no communication options"), ("torch_ddp+ce", "not 'torch_ddp'"),
                      ("zero1+local", "not 'zero1'"), ("bucketed_25+local+bf16", "sends nothing"),
                      ("torch_ddp+ostep2", "not 'torch_ddp'"), ("bucketed_25+ostep0", "unknown option 'ostep0'")):
        with pytest.raises(SystemExit):
            ddp.parse_args(["--device", "cpu", "--variants", bad])
        with pytest.raises(ValueError, match=said):
            ddp.Variant.parse(bad)


def test_variant_options_parse():
    assert ddp.Variant.parse("bucketed_25+ctas8+bf16") == ddp.Variant("bucketed_25", True, 8, True)
    assert ddp.Variant.parse("torch_ddp+carve16").sm_carveout == 16
    assert ddp.Variant.parse("torch_ddp+normal").group_key == (False, None)
    assert ddp.Variant.parse("torch_ddp").group_key is None
    assert ddp.Variant.parse("bucketed_25+thread").launch_thread
    assert ddp.Variant.parse("zero1+thread+stages1").exchange_stages == 1
    assert ddp.Variant.parse("zero1").exchange_stages is None
    assert ddp.Variant.parse("bucketed_25+thread+ce").copy_engine and ddp.Variant.parse("zero1+ce").copy_engine
    assert not ddp.Variant.parse("bucketed_25").copy_engine
    assert ddp.Variant.parse("bucketed_25+thread+local").local and ddp.Variant.parse("torch_ddp+local").local
    assert ddp.Variant.parse("bucketed_25+ce+ostep4").step_stages == 4 and ddp.Variant.parse("zero1").step_stages is None


def test_paired_bench_alternates_variants_and_reports_ratios(tmp_path):
    from lm_systems.bench import ddp_paired

    rows = ddp_paired.main(["--size", "tiny", "--vocab-size", "64", "--context-length", "16", "--batch-size", "1",
                            "--device", "cpu", "--nproc", "2", "--warmup", "1", "--iterations", "3", "--steps-per-turn",
                            "2", "--pairs", "single:bucketed_1,torch_ddp:bucketed_1+bf16,zero1:zero1+thread+stages4,"
                            "single:no_comm",
                            "--out-dir", str(tmp_path)])
    assert [(r["A"], r["B"]) for r in rows] == [("single", "bucketed_1"), ("torch_ddp", "bucketed_1+bf16"),
                                                ("zero1", "zero1+thread+stages4"), ("single", "no_comm")]
    for row in rows:
        assert row["iterations"] == 3 and row["A_ms"] > 0 and row["B_ms"] > 0
        assert row["B_over_A_q1"] <= row["B_over_A"] <= row["B_over_A_q3"]
    assert (tmp_path / "ddp_paired_tiny_2cpu.csv").exists()


def test_paired_bench_names_a_bad_pair():
    from lm_systems.bench import ddp_paired

    with pytest.raises(SystemExit):
        ddp_paired.parse_args(["--device", "cpu", "--pairs", "torch_ddp"])
    with pytest.raises(SystemExit):
        ddp_paired.parse_args(["--device", "cpu", "--pairs", "torch_ddp:bucketed_x"])
    with pytest.raises(SystemExit):
        ddp_paired.parse_args(["--device", "cpu", "--attention", "fastest"])
    with pytest.raises(SystemExit):
        ddp_paired.parse_args(["--device", "cpu", "--steps-per-turn", "0"])
    assert ddp_paired.parse_args(["--device", "cpu"]).attention == "sdpa"  # as bench.ddp's variant table


def test_compile_flag_takes_an_optional_mode_that_names_the_results():
    eager = ddp.parse_args(["--device", "cpu"])
    default = ddp.parse_args(["--device", "cpu", "--compile"])
    graphs = ddp.parse_args(["--device", "cpu", "--compile", "reduce-overhead"])
    assert (eager.compile, default.compile, graphs.compile) == (None, "default", "reduce-overhead")
    assert [ddp.run_label(a) for a in (eager, default, graphs)] == ["xl_2cpu", "xl_2cpu_compiled",
                                                                     "xl_2cpu_compiled_reduce_overhead"]
    assert "(mode reduce-overhead)" in ddp.setup_description(graphs)
    with pytest.raises(SystemExit):
        ddp.parse_args(["--device", "cpu", "--compile", "fastest"])


def test_reduce_overhead_runs_visit_after_visit(tmp_path):
    # Every visit after the first drops the compiled code (its CUDA graph pools would otherwise pile up on a
    # GPU) and compiles afresh; on the CPU there are no graphs, but the reset and recompiles run the same way.
    ddp.main(["--size", "tiny", "--vocab-size", "64", "--context-length", "16", "--batch-size", "1", "--device",
              "cpu", "--nproc", "2", "--steps", "1", "--warmup", "1", "--instrumented-steps", "0", "--rounds", "2",
              "--variants", "single,bucketed_1", "--compile", "reduce-overhead", "--out-dir", str(tmp_path)])
    with open(tmp_path / "ddp_tiny_2cpu_compiled_reduce_overhead_rounds.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["round"], r["variant"]) for r in rows] == [("0", "single"), ("0", "bucketed_1"), ("1", "single"),
                                                          ("1", "bucketed_1")]
    assert all(r["replicas_equal"] == "True" and float(r["step_ms"]) > 0 for r in rows)
