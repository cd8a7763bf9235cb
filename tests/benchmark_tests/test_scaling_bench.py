"""bench.scaling: setups parse into the train.py flags a user types, the table's ratios come from the same
round's visits, and a CPU run through train.py fills it."""

import argparse
import csv
import os
import sys
import time
from pathlib import Path

import pytest

from benchmarks import gpu_timeline
from benchmarks import scaling as bench


def test_setups_become_the_flags_a_user_types():
    assert bench.Setup.parse("single").train_py_args(2) == ["--devices", "1", "--strategy", "auto"]
    assert bench.Setup.parse("zero1").train_py_args(2) == ["--devices", "2", "--strategy", "zero1"]
    setup = bench.Setup.parse("ddp:100+find_unused_parameters=true+--model.compile=blocks@NCCL_ALGO=Ring")
    assert setup.train_py_args(4) == [
        "--devices",
        "4",
        "--trainer.strategy",
        "lightning.pytorch.strategies.DDPStrategy",
        "--trainer.strategy.bucket_cap_mb",
        "100",
        "--trainer.strategy.find_unused_parameters",
        "true",
        "--model.compile",
        "blocks",
    ]
    assert setup.env == (("NCCL_ALGO", "Ring"),)
    assert bench.Setup.parse("bucketed_ddp:25").train_py_args(2)[-2:] == ["--trainer.strategy.bucket_size_mb", "25"]


@pytest.mark.parametrize(
    "spec, said",
    [
        ("ddq", "unknown setup 'ddq'"),
        ("zero3:25", "zero3 takes no bucket size"),
        ("single:25", "unknown setup"),
        ("ddp+bucket_cap_mb", "key=value"),
    ],
)
def test_a_bad_setup_says_what_is_wrong(spec, said):
    with pytest.raises(argparse.ArgumentTypeError, match=said):
        bench.Setup.parse(spec)


def test_ratios_are_taken_within_each_round_then_the_median():
    args = bench.parse_args(
        ["--setups", "single", "ddp:25", "bucketed_ddp", "--rounds", "3", "--configs", "64x2:eager"]
    )
    config = args.configs[0]
    single, ddp, bucketed = args.setups
    times = {single: [100, 200, 100], ddp: [150, 260, 125], bucketed: [110, 250, 120]}
    runs = [
        bench.Run(config, setup, r, segment_ms=[ms], peak_GiB=[1.0, 2.0])
        for r in range(3)
        for setup, series in times.items()
        for ms in [series[r]]
    ]
    rows = {row["setup"]: row for row in bench.rows(runs, args)}
    assert rows["bucketed_ddp"]["ms_per_step"] == 120
    assert rows["bucketed_ddp"]["scaling"] == pytest.approx(sorted([100 / 110, 200 / 250, 100 / 120])[1])
    assert rows["bucketed_ddp"]["over_baseline"] == pytest.approx(sorted([110 / 150, 250 / 260, 120 / 125])[1])
    assert rows["bucketed_ddp"]["tokens_per_s"] == pytest.approx(2 * 2 * 64 / 120 * 1e3)
    assert rows["single"]["devices"] == 1 and rows["single"]["tokens_per_s"] == pytest.approx(2 * 64 / 100 * 1e3)
    assert rows["ddp:25"]["peak_GiB_per_rank"] == 2.0
    args.baseline = "single"
    rows = {row["setup"]: row for row in bench.rows(runs, args)}
    assert rows["bucketed_ddp"]["over_baseline"] == pytest.approx(sorted([110 / 100, 250 / 200, 120 / 100])[1])


def test_a_setups_own_flag_wins_over_the_flags_for_every_setup(tmp_path):
    args = bench.parse_args(
        [
            "--setups",
            "zero3+--model.activation_checkpointing=keep_attention",
            "--train-py-flags",
            "--model.activation_checkpointing blocks",
        ]
    )
    command = bench.visit_command(args.configs[0], args.setups[0], args, tmp_path, tmp_path / "timer")
    given = [i for i, arg in enumerate(command) if arg == "--model.activation_checkpointing"]
    assert command[given[-1] + 1] == "keep_attention"  # LightningCLI takes the last value given


def test_cold_caches_point_every_cache_at_a_new_folder(tmp_path):
    env = bench.cold_caches(tmp_path / "visit0_caches")
    assert set(env) == {"TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "LM_SYSTEMS_TUNING_CACHE"}
    assert all(
        Path(folder).parent == tmp_path / "visit0_caches" and not Path(folder).exists() for folder in env.values()
    )
    assert len(set(env.values())) == 3


def test_mfu_is_the_model_flops_of_a_step_over_its_time_and_the_peak():
    record = {"flops_per_step": 2.64e15, "peak_flops": 989e12}
    assert bench.model_flops_utilisation(record, 5000.0) == pytest.approx(2.64e15 / 5.0 / 989e12)
    assert bench.model_flops_utilisation({**record, "peak_flops": None}, 5000.0) is None  # a CPU: no peak known


def test_a_baseline_must_be_one_of_the_setups():
    with pytest.raises(SystemExit):
        bench.parse_args(["--setups", "single", "--baseline", "ddp:25"])


@pytest.mark.slow
def test_cpu_run_through_train_py_fills_the_table(tmp_path):
    out = tmp_path / "out"
    bench.main(
        [
            "--size",
            "tiny",
            "--configs",
            "16x2:eager",
            "--accelerator",
            "cpu",
            "--precision",
            "32-true",
            "--setups",
            "single",
            "bucketed_ddp:1",
            "zero3+compute_dtype=bf16",
            "--warmup",
            "1",
            "--steps",
            "2",
            "--segments",
            "2",
            "--trace-steps",
            "1",
            "--out-dir",
            str(out),
            "--cold-caches",
            "--train-py-flags",
            f"--data.cache_dir {tmp_path / 'data'} --data.generated_stories 300 --data.vocab_size 300",
        ]
    )
    rows = {row["setup"]: row for row in csv.DictReader((out / "scaling.csv").open())}
    assert set(rows) == {"single", "bucketed_ddp:1", "zero3+compute_dtype=bf16"}
    for row in rows.values():
        assert row["error"] == "" and row["rounds"] == "1" and float(row["ms_per_step"]) > 0
        # Start-up and one warm-up step come before the first timed one; a CPU has no peak, so no MFU.
        assert float(row["first_timed_s"]) > float(row["ms_per_step"]) / 1e3 and row["mfu"] == ""
    bucketed = rows["bucketed_ddp:1"]
    assert bucketed["devices"] == "2"
    assert float(bucketed["scaling"]) == pytest.approx(
        float(rows["single"]["ms_per_step"]) / float(bucketed["ms_per_step"]), rel=1e-3
    )
    # One traced step after the timed ones, on every rank: its window is read (no GPU here: its columns say nan).
    traced = [(row["setup"], row["rank"], row) for row in csv.DictReader((out / "scaling_timeline.csv").open())]
    assert sorted((setup, rank) for setup, rank, _ in traced) == [
        ("bucketed_ddp:1", "0"),
        ("bucketed_ddp:1", "1"),
        ("single", "0"),
        ("zero3+compute_dtype=bf16", "0"),
        ("zero3+compute_dtype=bf16", "1"),
    ]
    for _, _, row in traced:
        assert float(row["traced_ms_per_step"]) > 0 and row["gpu_idle_ms"] == "nan"
    # The traces themselves stay, a file per visit and rank, each the window the table read.
    kept = sorted(path.name for path in (out / "scaling_traces").iterdir())
    assert kept == [
        "ctx16_2_eager_bucketed_ddp_1_round1_rank0.json.gz",
        "ctx16_2_eager_bucketed_ddp_1_round1_rank1.json.gz",
        "ctx16_2_eager_single_round1_rank0.json.gz",
        "ctx16_2_eager_zero3_compute_dtype_bf16_round1_rank0.json.gz",
        "ctx16_2_eager_zero3_compute_dtype_bf16_round1_rank1.json.gz",
    ]
    single = gpu_timeline.summarize_file(out / "scaling_traces" / kept[2], steps=1)
    table_row = next(row for setup, _, row in traced if setup == "single")
    assert single["traced_ms_per_step"] == pytest.approx(float(table_row["traced_ms_per_step"]))


@pytest.mark.slow
def test_a_visit_past_its_time_limit_stops_every_process_it_started(tmp_path):
    """Lightning starts the other ranks as children of rank 0: killing rank 0 alone would leave them on their GPUs."""
    pid_file = tmp_path / "child.pid"
    parent = (
        "import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'import time; "
        f"time.sleep(60)']); open({str(pid_file)!r}, 'w').write(str(child.pid)); time.sleep(60)"
    )
    with (tmp_path / "log").open("w") as out:
        started = time.monotonic()
        assert bench.run_in_own_group([sys.executable, "-c", parent], dict(os.environ), out, timeout=3) is None
    assert time.monotonic() - started < 30
    child = int(pid_file.read_text())
    for _ in range(50):
        if not alive(child):
            return
        time.sleep(0.1)
    raise AssertionError(f"the child {child} outlived its group")


def alive(pid: int) -> bool:
    """Running: neither gone nor a zombie (killed, waiting for whoever adopted it to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
