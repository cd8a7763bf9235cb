"""RunSummary: the lines a finished train.py run ends with (train.py's whole console: tests/test_run_output.py)."""

import re

import pytest

from lm_systems.run_callbacks.summary import _duration
from train import main


@pytest.fixture
def fast(tiny_args) -> list[str]:
    return [
        *tiny_args,
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.val_check_interval",
        "3",
        "--trainer.log_every_n_steps",
        "3",
    ]


def _summary(out: str) -> dict[str, str]:
    lines = out[out.rindex("\nfinished ") :].strip().splitlines()
    return {line[:11].strip(): line[12:] for line in lines}


@pytest.mark.slow
def test_a_run_and_its_resumption_say_what_they_did_and_where(tmp_path, monkeypatch, capsys, fast):
    monkeypatch.chdir(tmp_path)
    main([*fast, "--max_steps", "4"])
    first = _summary(capsys.readouterr().out)
    assert re.fullmatch(r"4 steps in \d+\.\d s", first["finished"])
    assert re.fullmatch(r"train \d\.\d{3} at step 3, validation \d\.\d{3} at step 3", first["loss"])  # not at 4
    assert first["tokens"] == "128 (32 a step)"  # batch 2 × context 16
    speed = re.fullmatch(
        r"([\d,]+) tokens/s, ([\d.e-]+) s a step \(after step 1, validation left out\)", first["speed"]
    )
    tokens_per_s, seconds_a_step = float(speed[1].replace(",", "")), float(speed[2])
    assert tokens_per_s * seconds_a_step == pytest.approx(32, rel=0.01)  # the same timed steps, 32 tokens each
    assert re.fullmatch(
        r"done \d+\.\d s after start-up \(data, model, compiling and tuning included\)", first["first step"]
    )
    assert first["MFU"] == "unknown: no peak FLOP/s known for cpu (MFUMonitor's peak_flops_per_s sets one)"
    assert first["checkpoint"] == "logs/lm_systems/version_0/checkpoints/last.ckpt"

    main([*fast, "--max_steps", "6", "--ckpt_path", first["checkpoint"]])
    resumed = _summary(capsys.readouterr().out)
    assert resumed["finished"].startswith("2 steps (resumed at step 4, now 6) in ")
    assert resumed["tokens"] == "64 (32 a step)"
    assert resumed["checkpoint"] == "logs/lm_systems/version_1/checkpoints/last.ckpt"
    assert resumed["sample it"] == f"python -m lm_systems.generate --ckpt {resumed['checkpoint']}"
    assert resumed["view it"] == "tensorboard --logdir logs"


def test_a_synthetic_run_offers_no_sample_command(tmp_path, monkeypatch, capsys, fast):
    """Synthetic tokens have no tokenizer: ``generate`` could not decode what it samples."""
    monkeypatch.chdir(tmp_path)
    main([*fast, "--max_steps", "1", "--data.synthetic", "true", "--data.vocab_size", "300"])
    summary = _summary(capsys.readouterr().out)
    assert summary["checkpoint"] == "logs/lm_systems/version_0/checkpoints/last.ckpt"
    assert "sample it" not in summary and "view it" in summary


@pytest.mark.slow
def test_no_summary_after_a_failed_run(tmp_path, monkeypatch, capsys, fast):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        main([*fast, "--max_steps", "4", "--model.lr", "1e9", "--trainer.gradient_clip_val", "0"])  # diverges
    assert "\nfinished " not in capsys.readouterr().out


@pytest.mark.parametrize("seconds, text", [(4.25, "4.2 s"), (101, "1 min 41 s"), (7500, "2 h 05 min")])
def test_durations_read_as_a_person_says_them(seconds, text):
    assert _duration(seconds) == text
