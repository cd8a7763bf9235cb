"""bench.train on the CPU: both paths train the same setup, and the table carries the ratio rows."""

import csv
import statistics
import weakref
from unittest.mock import patch

import pytest
import torch

from benchmarks import train as bench
from lm_systems.attention import registry
from lm_systems.attention.naive import naive_attention
from lm_systems.data.datamodule import LMDataModule
from lm_systems.lit_module import LitLM


@pytest.mark.slow
def test_cpu_run_writes_both_paths_their_ratio_and_the_attention_ratio(tmp_path, monkeypatch):
    """The rows against the segments' own times (each setup's Rounds, as summary_rows received them): medians,
    ranges, and ratios taken segment by segment."""
    monkeypatch.chdir(tmp_path)  # data cache and logs land here
    measured, summary_rows = {}, bench.summary_rows

    def recording(setup, rounds, *args):
        measured[setup.attention] = rounds
        return summary_rows(setup, rounds, *args)

    monkeypatch.setattr(bench, "summary_rows", recording)
    bench.main(
        [
            "--size",
            "tiny",
            "--shapes",
            "32x2",
            "--attention",
            "sdpa",
            "naive",
            "--compile",
            "off",
            "--rounds",
            "2",
            "--warmup",
            "1",
            "--steps",
            "2",
            "--out-dir",
            str(tmp_path / "out"),
        ]
    )
    rows = list(csv.DictReader((tmp_path / "out" / "train_step.csv").open()))

    def assert_row(row, values: list[float]) -> None:
        assert int(row["rounds"]) == len(values)
        assert float(row["ms_per_step"]) == pytest.approx(statistics.median(values))
        assert (float(row["min_ms"]), float(row["max_ms"])) == pytest.approx((min(values), max(values)))

    for attention in ("sdpa", "naive"):
        by_path = {row["path"]: row for row in rows if row["setup"].endswith(attention)}
        assert set(by_path) == {"train_py", "plain", "train_py / plain"}
        train_py, plain = (m.ms_per_step for m in measured[attention].train_py), measured[attention].plain[attention]
        train_py, plain = list(train_py), [m.ms_per_step for m in plain]
        assert len(train_py) == len(plain) == 2 and min(train_py + plain) > 0
        assert_row(by_path["train_py"], train_py)
        assert_row(by_path["plain"], plain)
        assert_row(by_path["train_py / plain"], [a / b for a, b in zip(train_py, plain, strict=True)])
    # Both setups' plain loops ran both attentions: two segments each, four ratios.
    (attention,) = [row for row in rows if row["path"] == "plain naive / sdpa"]
    assert attention["setup"] == "tiny ctx32×2 bf16-mixed"
    assert_row(
        attention,
        [
            a.ms_per_step / b.ms_per_step
            for rounds in measured.values()
            for a, b in zip(rounds.plain["naive"], rounds.plain["sdpa"], strict=True)
        ],
    )


@pytest.mark.slow
def test_the_plain_loop_switches_attention_in_place(tmp_path):
    data = LMDataModule(context_length=16, batch_size=2, generated_stories=300, vocab_size=300, cache_dir=str(tmp_path))
    data.prepare_data()
    plain = bench.PlainLoop(bench.Setup("tiny", 16, 2, "32-true", "sdpa", False), data, torch.device("cpu"), 4)
    called = []
    counted_naive = {"naive": lambda *args: called.append("naive") or naive_attention(*args)}
    plain.use_attention("naive")
    with patch.dict(registry._REGISTRY, counted_naive):
        plain.step()
    assert called == ["naive"] * plain.model.config.num_layers


TINY_RUN = [
    "--size",
    "tiny",
    "--shapes",
    "32x2",
    "--attention",
    "sdpa",
    "--compile",
    "off",
    "--rounds",
    "2",
    "--warmup",
    "1",
    "--steps",
    "2",
    "--device",
    "cpu",
]
"""A tiny model, two rounds of two steps, on the CPU."""


class Killed(Exception):
    """Stands in for the device's call limit ending the process (Lightning catches KeyboardInterrupt itself)."""


@pytest.mark.slow
def test_a_run_cut_short_keeps_the_rounds_it_finished(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    step, calls = bench.PlainLoop.step, []

    def step_then_killed(self):
        calls.append(1)
        if len(calls) == 1 + 2 + 1:  # warm-up, round 0, then round 1: the call limit kills the process
            raise Killed
        return step(self)

    monkeypatch.setattr(bench.PlainLoop, "step", step_then_killed)
    with pytest.raises(Killed):
        bench.main([*TINY_RUN, "--out-dir", str(tmp_path / "out")])
    rows = list(csv.DictReader((tmp_path / "out" / "train_step.csv").open()))
    assert {row["path"]: row["rounds"] for row in rows} == {"train_py": "1", "plain": "1", "train_py / plain": "1"}


@pytest.mark.parametrize("shape, message", [("512", "CONTEXTxBATCH"), ("0x4", "positive")])
def test_bad_shape_names_the_flag(shape, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--shapes", shape])
    err = capsys.readouterr().err
    assert "--shapes" in err and message in err


def test_train_py_args_parse_as_the_cli_reads_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    setup = bench.Setup("tiny", 32, 2, "bf16-mixed", "sdpa", compile=True)
    from train import main

    cli = main(
        [
            *bench.train_py_args(setup, 5, tmp_path, torch.device("cpu")),
            "--data.generated_stories",
            "300",
            "--data.vocab_size",
            "300",
        ],
        run=False,
    )
    assert cli.model.hparams.compile and cli.model.hparams.attention == "sdpa" and cli.model.hparams.lr == bench.LR
    assert cli.datamodule.batch_size == 2 and cli.datamodule.context_length == 32
    assert cli.trainer.max_steps == 5 and cli.trainer.gradient_clip_val == bench.CLIP
    assert cli.trainer.strategy.root_device == torch.device("cpu")  # --device cpu holds on a GPU host too
    on_gpu = bench.train_py_args(setup, 5, tmp_path, torch.device("cuda", 0))
    assert on_gpu[on_gpu.index("--accelerator") + 1] == "gpu"


def test_default_attention_leaves_out_the_cuda_kernel_on_the_cpu(capsys):
    assert bench.parse_args(["--device", "cpu"]).attention == ["sdpa"]
    assert bench.parse_args(["--device", "cpu", "--attention", "naive"]).attention == ["naive"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--attention", "fastest"])
    assert "--attention: invalid choice: 'fastest'" in capsys.readouterr().err


@pytest.mark.slow
def test_each_setup_lets_go_of_its_models_before_the_next(tmp_path, monkeypatch):
    """Two xl models fill a GPU: the next setup can only start once the last one's are gone."""
    monkeypatch.chdir(tmp_path)
    made, alive = weakref.WeakSet(), []
    for kind, method in ((LitLM, "setup"), (bench.PlainLoop, "step")):

        def recording(self, *args, _original=getattr(kind, method), **kwargs):  # noqa: B008  binds this turn's method
            made.add(self)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(kind, method, recording)
    free_memory = bench.free_memory

    def count_then_free(device):
        free_memory(device)
        alive.append(len(made))

    monkeypatch.setattr(bench, "free_memory", count_then_free)
    bench.main(
        [
            "--size",
            "tiny",
            "--shapes",
            "32x2",
            "--attention",
            "sdpa",
            "naive",
            "--compile",
            "off",
            "--rounds",
            "1",
            "--warmup",
            "1",
            "--steps",
            "1",
            "--out-dir",
            str(tmp_path / "out"),
        ]
    )
    assert alive == [0, 0]


@pytest.mark.slow
def test_a_setup_in_its_own_process_sends_each_round_back(tmp_path, monkeypatch):
    """What the bench does on a GPU, run on the CPU: a spawned process per setup."""
    monkeypatch.chdir(tmp_path)
    args = bench.parse_args(TINY_RUN)
    received = []
    bench.run_setup_in_own_process(
        bench.Setup("tiny", 32, 2, "bf16-mixed", "sdpa", False),
        args,
        tmp_path,
        lambda rounds: received.append(len(rounds.train_py)),
    )
    assert received == [1, 2]


@pytest.mark.slow
def test_a_setup_that_fails_in_its_own_process_says_which(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = bench.parse_args([*TINY_RUN, "--train-py-flags", "--model.lr -1"])
    with pytest.raises(RuntimeError, match=r"tiny ctx32×2 bf16-mixed sdpa failed in its process \(exit code 2\)"):
        bench.run_setup_in_own_process(
            bench.Setup("tiny", 32, 2, "bf16-mixed", "sdpa", False), args, tmp_path, lambda rounds: None
        )
