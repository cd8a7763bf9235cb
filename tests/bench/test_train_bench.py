"""bench.train on the CPU: both paths train the same setup, and the table carries the ratio rows."""

import csv

import pytest
import torch

from lm_systems.bench import train as bench


def test_cpu_run_writes_both_paths_and_their_ratio(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # data cache and logs land here
    bench.main(["--size", "tiny", "--shapes", "32x2", "--attention", "sdpa", "--compile", "off", "--rounds", "2",
                "--warmup", "1", "--steps", "2", "--out-dir", str(tmp_path / "out")])
    rows = list(csv.DictReader((tmp_path / "out" / "train_step.csv").open()))
    by_path = {row["path"]: row for row in rows}
    assert set(by_path) == {"train_py", "plain", "train_py / plain"}
    for path in ("train_py", "plain"):
        assert by_path[path]["rounds"] == "2" and float(by_path[path]["ms_per_step"]) > 0
    ratio = by_path["train_py / plain"]
    assert float(ratio["min_ms"]) <= float(ratio["ms_per_step"]) <= float(ratio["max_ms"])
    expected = float(by_path["train_py"]["ms_per_step"]) / float(by_path["plain"]["ms_per_step"])
    assert float(ratio["ms_per_step"]) == pytest.approx(expected, rel=0.6)  # a median of per-round ratios


def test_a_run_cut_short_keeps_the_rounds_it_finished(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_plain, calls = bench.run_plain, []

    def plain_then_killed(*args):
        calls.append(1)
        if len(calls) == 2:  # round 1 (plain runs first there): the call limit kills the process
            raise KeyboardInterrupt
        return run_plain(*args)

    monkeypatch.setattr(bench, "run_plain", plain_then_killed)
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--size", "tiny", "--shapes", "32x2", "--attention", "sdpa", "--compile", "off", "--rounds", "2",
                    "--warmup", "1", "--steps", "2", "--out-dir", str(tmp_path / "out")])
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
    from lm_systems.cli import main
    cli = main([*bench.train_py_args(setup, 5, tmp_path, torch.device("cpu")), "--data.generated_stories", "300",
                "--data.vocab_size", "300"], run=False)
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
