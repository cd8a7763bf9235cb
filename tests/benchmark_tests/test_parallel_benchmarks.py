"""The communication and data-parallel benchmarks: their arithmetic on hand-made numbers, and end to end on the
CPU (gloo, two processes, tiny sizes; each benchmark run once per module and shared by the tests that read it)."""

import csv

import pytest

from benchmarks import comm, ddp
from benchmarks.ddp_variants import Variant

TINY = [
    "--size",
    "tiny",
    "--vocab-size",
    "64",
    "--context-length",
    "16",
    "--batch-size",
    "1",
    "--device",
    "cpu",
    "--nproc",
    "2",
]
DDP_VARIANTS = ["single", "torch_ddp", "bucketed_1", "zero1", "bucketed_1+hp", "bucketed_1+thread", "naive", "overlap"]
PAIRS = [
    ("single", "bucketed_1"),
    ("torch_ddp", "bucketed_1+hp"),
    ("zero1", "zero1+thread+stages4"),
    ("single", "overlap+thread"),
]


def test_bus_bandwidth_at_four_ranks():
    # A ring all-reduce over n ranks moves 2(n-1)/n of the bytes over each link: 1.5 at n = 4.
    assert comm.bus_bandwidth(nbytes=1_000_000_000, seconds=1.0, nproc=4) == pytest.approx(1.5e9)
    assert comm.bus_bandwidth(nbytes=400_000_000, seconds=0.5, nproc=4) == pytest.approx(1.2e9)
    assert comm.bus_bandwidth(nbytes=1_000_000_000, seconds=2.0, nproc=2) == pytest.approx(0.5e9)


@pytest.mark.slow  # two spawned ranks
def test_comm_bench_reports_bandwidths(tmp_path):
    rows = comm.main(
        [
            "--backend",
            "gloo",
            "--nproc",
            "2",
            "--sizes-mb",
            "0.01,0.1",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--out-dir",
            str(tmp_path),
        ]
    )
    assert [r["size_mb"] for r in rows] == [0.01, 0.1]
    for row in rows:
        seconds = row["time_ms"] * 1e-3
        assert row["algbw_GBps"] == pytest.approx(row["size_mb"] * 1e6 / seconds / 1e9)
        assert row["busbw_GBps"] == pytest.approx(row["size_mb"] * 1e6 / seconds / 1e9)  # n = 2: 2(n-1)/n = 1
    assert {p.name for p in tmp_path.iterdir()} == {f"comm_gloo_2proc.{ext}" for ext in ("csv", "md", "png")}


def test_comm_bench_names_a_bad_process_count(capsys):
    with pytest.raises(SystemExit):
        comm.parse_args(["--backend", "gloo", "--nproc", "1"])
    assert "--nproc must be at least 2" in capsys.readouterr().err


def test_summary_takes_ratios_within_each_round():
    rows = [
        {"round": 0, "variant": "single", "nproc": 1, "step_ms": 100.0, "replicas_equal": True},
        {"round": 0, "variant": "torch_ddp", "nproc": 2, "step_ms": 120.0, "replicas_equal": True},
        {"round": 0, "variant": "bucketed_25", "nproc": 2, "step_ms": 150.0, "replicas_equal": True},
        {"round": 1, "variant": "single", "nproc": 1, "step_ms": 110.0, "replicas_equal": True},
        {"round": 1, "variant": "torch_ddp", "nproc": 2, "step_ms": 100.0, "replicas_equal": True},
        {"round": 1, "variant": "bucketed_25", "nproc": 2, "step_ms": 130.0, "replicas_equal": False},
    ]
    summary = {r["variant"]: r for r in ddp.summarize(rows)}
    bucketed = summary["bucketed_25"]
    assert bucketed["step_ms"] == 140.0 and bucketed["rounds"] == 2
    assert bucketed["vs_torch_ddp"] == pytest.approx((150 / 120 + 130 / 100) / 2)  # 1.275, not 140 / 110
    assert bucketed["scaling_eff"] == pytest.approx((100 / 150 + 110 / 130) / 2)
    assert summary["single"]["vs_torch_ddp"] == pytest.approx((100 / 120 + 110 / 100) / 2)
    assert not bucketed["replicas_equal"] and summary["torch_ddp"]["replicas_equal"]


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    rows = ddp.main(
        [
            *TINY,
            "--steps",
            "1",
            "--warmup",
            "1",
            "--instrumented-steps",
            "1",
            "--rounds",
            "1",
            "--variants",
            ",".join(DDP_VARIANTS),
            "--out-dir",
            str(out),
        ]
    )
    with open(out / "ddp_tiny_2cpu.csv") as f:
        return rows, {row["variant"]: row for row in csv.DictReader(f)}, out


@pytest.mark.slow  # two spawned ranks
def test_ddp_bench_compares_variants_and_keeps_replicas_equal(ddp_run):
    rows, summary, out = ddp_run
    assert [r["variant"] for r in rows] == DDP_VARIANTS and list(summary) == DDP_VARIANTS
    assert all(row["replicas_equal"] == "True" for row in summary.values())
    # ZeRO-1 keeps half of AdamW's state per rank on two ranks.
    full, sharded = float(summary["bucketed_1"]["opt_state_GB"]), float(summary["zero1"]["opt_state_GB"])
    assert 0.4 * full < sharded < 0.6 * full
    assert (out / "ddp_tiny_2cpu.png").exists() and (out / "ddp_tiny_2cpu.md").exists()


@pytest.mark.slow  # two spawned ranks
def test_ddp_bench_times_the_phases_of_a_step(ddp_run):
    rows, _, _ = ddp_run
    for row in rows:
        phases = [row[f"{p}_ms"] for p in ("forward", "backward", "sync", "optimizer")]
        assert all(t >= 0 for t in phases) and row["step_ms"] > 0
    assert {r["variant"]: r["nproc"] for r in rows}["single"] == 1


@pytest.mark.parametrize(
    "bad, said",
    [
        ("bucketed_x", "unknown variant 'bucketed_x'"),
        ("torch_ddp+fast", "unknown option 'fast'"),
        ("single+hp", "takes no communication options"),
        ("torch_ddp+thread", "not 'torch_ddp'"),
        ("naive+thread", "not 'naive'"),
        ("bucketed_25+stages2", "not 'bucketed_25'"),
        ("zero1+stages0", "unknown option 'stages0'"),
        ("bucketed_25+ctas", "unknown option 'ctas'"),
    ],
)
def test_ddp_bench_names_a_bad_variant_or_option(bad, said, capsys):
    with pytest.raises(SystemExit):
        ddp.parse_args(["--device", "cpu", "--variants", bad])
    assert "--variants" in capsys.readouterr().err
    with pytest.raises(ValueError, match=said):
        Variant.parse(bad)


def test_variant_options_parse():
    assert Variant.parse("bucketed_25+hp+thread") == Variant("bucketed_25", True, True)
    assert Variant.parse("torch_ddp+hp").high_priority
    assert not Variant.parse("torch_ddp").high_priority
    assert Variant.parse("bucketed_25+thread").launch_thread and Variant.parse("overlap+thread").launch_thread
    assert Variant.parse("zero1+thread+stages1").exchange_stages == 1
    assert Variant.parse("zero1").exchange_stages is None


@pytest.fixture(scope="module")
def paired_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("paired")
    rows = ddp.main(
        [
            *TINY,
            "--warmup",
            "1",
            "--iterations",
            "3",
            "--steps-per-turn",
            "2",
            "--pairs",
            ",".join(f"{a}:{b}" for a, b in PAIRS),
            "--out-dir",
            str(out),
        ]
    )
    return rows, out


@pytest.mark.slow  # two spawned ranks
def test_paired_bench_alternates_variants_and_reports_ratios(paired_run):
    """Every pair timed for the asked iterations, and the file holds the rows measured (pair_row's arithmetic on
    per-iteration times is checked by hand below: the ranks compute it, out of this process's reach)."""
    rows, out = paired_run
    assert [(r["A"], r["B"]) for r in rows] == PAIRS
    with open(out / "ddp_paired_tiny_2cpu.csv") as f:
        written = list(csv.DictReader(f))
    assert len(written) == len(rows)
    for row, line in zip(rows, written, strict=True):
        assert row["iterations"] == int(line["iterations"]) == 3 and row["A_ms"] > 0 and row["B_ms"] > 0
        for column in ("A_ms", "B_ms", "B_over_A", "B_over_A_q1", "B_over_A_q3"):
            assert float(line[column]) == row[column], column


def test_pair_row_takes_the_median_of_per_iteration_ratios():
    row = ddp.pair_row(("a", "b"), ([0.1, 0.2, 0.1], [0.12, 0.2, 0.15]))
    assert row["B_over_A"] == pytest.approx(1.2)  # ratios 1.2, 1.0, 1.5
    assert (row["B_over_A_q1"], row["B_over_A_q3"]) == pytest.approx((1.0, 1.5)) and row["iterations"] == 3
    assert row["A_ms"] == pytest.approx(100.0) and row["B_ms"] == pytest.approx(150.0)


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--pairs", "torch_ddp"], "a pair is A:B, got 'torch_ddp'"),
        (["--pairs", "torch_ddp:bucketed_x"], "unknown variant 'bucketed_x'"),
        (["--attention", "fastest"], "--attention: invalid choice: 'fastest'"),
        (["--pairs", "single:zero1", "--variants", "zero1"], "not allowed with argument --pairs"),
        (["--steps-per-turn", "0"], "--steps-per-turn must be at least 1, got 0"),
    ],
)
def test_paired_bench_names_a_bad_pair(argv, said, capsys):
    with pytest.raises(SystemExit):
        ddp.parse_args(["--device", "cpu", *argv])
    assert said in capsys.readouterr().err


def test_ddp_bench_defaults_to_sdpa_attention_and_every_strategy():
    args = ddp.parse_args(["--device", "cpu"])
    assert args.attention == "sdpa" and args.pairs is None and args.nproc == 2
    assert {Variant.parse(v).base for v in args.variants} >= {"single", "torch_ddp", "naive", "overlap", "zero1"}


@pytest.mark.slow  # two spawned ranks
def test_rounds_interleave_the_variants(tmp_path):
    rows = ddp.main(
        [
            *TINY,
            "--steps",
            "1",
            "--warmup",
            "1",
            "--instrumented-steps",
            "0",
            "--rounds",
            "2",
            "--variants",
            "single,bucketed_1",
            "--out-dir",
            str(tmp_path),
        ]
    )
    assert [(r["round"], r["variant"]) for r in rows] == [
        (0, "single"),
        (0, "bucketed_1"),
        (1, "single"),
        (1, "bucketed_1"),
    ]
    assert all(r["replicas_equal"] and r["step_ms"] > 0 for r in rows)
    assert (tmp_path / "ddp_tiny_2cpu.csv").exists()
