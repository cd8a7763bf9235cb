"""What a train.py run shows a person, read as they read it: the console (quiet; a summary naming this run's
checkpoint and logs), the README's commands after two runs, and TensorBoard's event files (tags, steps, the
hyperparameters' metric, the text samples)."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from lm_systems.cli import TRAINER_DEFAULTS

REPO = Path(__file__).resolve().parents[1]
STEPS, VAL_EVERY, LOG_EVERY = 12, 4, 2
PROMPT = "Once upon a time"
RUN = [
    "--max_steps",
    str(STEPS),
    "--trainer.val_check_interval",
    str(VAL_EVERY),
    "--trainer.log_every_n_steps",
    str(LOG_EVERY),
    "--data.val_batches",
    "2",
    "--model.sample_prompt",
    PROMPT,
    "--model.sample_tokens",
    "8",
]
WITH_PEAK = ["--trainer.callbacks+=callbacks.MFUMonitor", "--trainer.callbacks.peak_flops_per_s=1e12"]
TOKENS_PER_STEP = 2 * 16  # tests/conftest.py's TINY: batch 2, context 16


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, train_py) -> tuple[Path, list[str]]:
    """The folder two runs of train.py ran in, and their consoles (stderr, then stdout, which the summary ends): the
    first on a CPU's unknown peak, the second with a peak to measure MFU against."""
    cwd = tmp_path_factory.mktemp("runs")
    consoles = []
    for extra in ([], WITH_PEAK):
        done = train_py.run_ok(*train_py.tiny, *RUN, *extra, cwd=cwd)
        consoles.append(done.stderr + done.stdout)
    return cwd, consoles


def _events(cwd: Path, version: int) -> EventAccumulator:
    return EventAccumulator(
        str(cwd / "logs" / "lm_systems" / f"version_{version}"), size_guidance={"tensors": 0}
    ).Reload()


def _summary(console: str) -> dict[str, str]:
    """The summary's ``key value`` lines, from its first (``finished``) to the end."""
    lines = console[console.rindex("\nfinished ") :].strip().splitlines()
    return {line[:11].strip(): line[12:] for line in lines}


@pytest.mark.slow
def test_the_console_is_quiet_and_explains_its_numbers(two_runs):
    _, (first, second) = two_runs
    for untelling in ("GPU available", "TPU available", "FLOPs", "model summary", "`Trainer.fit` stopped", "v_num"):
        assert untelling not in first + second, untelling
    assert re.search(r"TransformerLM tiny: [\d.]+M parameters at vocab 300,.*training on cpu in 32-true", first)


@pytest.mark.slow
def test_the_summary_names_this_run_and_how_to_open_it(two_runs):
    cwd, (first, second) = two_runs
    for console, version in ((first, 0), (second, 1)):
        summary = _summary(console)
        assert summary["finished"].startswith(f"{STEPS} steps in ")
        assert re.fullmatch(r"train \d+\.\d{3}, validation \d+\.\d{3}", summary["loss"])
        assert summary["tokens"] == f"{STEPS * TOKENS_PER_STEP:,} ({TOKENS_PER_STEP} a step)"
        checkpoint = f"logs/lm_systems/version_{version}/checkpoints/last.ckpt"
        assert summary["checkpoint"] == checkpoint and (cwd / checkpoint).is_file()
        assert summary["logs"] == f"logs/lm_systems/version_{version} (TensorBoard run lm_systems/version_{version})"
        assert summary["sample it"] == f"python -m lm_systems.generate --ckpt {checkpoint}"
        assert summary["view it"] == "tensorboard --logdir logs"
    assert _summary(first)["MFU"].startswith("unknown: no peak FLOP/s known for cpu")
    assert re.fullmatch(r"\d+\.\d% of 1 TFLOP/s per device", _summary(second)["MFU"])


def _readme_line(start: str) -> str:
    lines = [line.split("#")[0].strip() for line in (REPO / "README.md").read_text().splitlines()]
    return next(line for line in lines if line.startswith(start))


@pytest.mark.slow
def test_the_readmes_commands_open_the_newest_run(two_runs, train_py):
    cwd, _ = two_runs
    generate = _readme_line("python -m lm_systems.generate")
    python, *args = shlex.split(generate)
    assert python == "python"
    done = subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=300, env=train_py.environment()
    )
    assert done.returncode == 0, done.stderr
    assert "version_1" in done.stderr and PROMPT in done.stdout
    logdir = _readme_line("tensorboard --logdir").split()[2]
    assert sorted(p.parent.name for p in (cwd / logdir).glob("*/*/events.out.tfevents.*")) == ["version_0", "version_1"]


TAGS = {
    "train/loss",
    "train/perplexity",
    "train/lr",
    "train/grad_norm",
    "train/tokens_per_sec",
    "train/mfu",
    "val/loss",
    "val/perplexity",
}


@pytest.mark.slow
def test_tensorboard_has_each_measure_once_under_a_name_that_says_it(two_runs):
    cwd, _ = two_runs
    events = _events(cwd, 1)
    assert set(events.Tags()["scalars"]) == TAGS  # no epoch, validate/*, lr per group, batches or samples counts
    series = {tag: tuple(event.value for event in events.Scalars(tag)) for tag in TAGS}
    for tag, values in series.items():
        assert len(set(values)) > 1, f"{tag} is constant: {values}"
    assert len(set(series.values())) == len(series), "two tags draw the same curve"
    assert "train/mfu" not in _events(cwd, 0).Tags()["scalars"]  # no peak known: none made up


@pytest.mark.slow
def test_validation_is_on_the_training_step_axis(two_runs):
    cwd, _ = two_runs
    events = _events(cwd, 1)
    train_steps = [event.step for event in events.Scalars("train/loss")]
    assert train_steps == list(range(LOG_EVERY - 1, STEPS, LOG_EVERY))
    expected = list(range(VAL_EVERY - 1, STEPS, VAL_EVERY))  # after steps 4, 8, 12: where train/loss is drawn
    for tag in ("val/loss", "val/perplexity"):
        assert [event.step for event in events.Scalars(tag)] == expected


@pytest.mark.slow
def test_hyperparameters_are_shown_against_validation_loss(two_runs):
    cwd, _ = two_runs
    content = _events(cwd, 1).PluginTagToContent("hparams")
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert [metric.name.tag for metric in experiment.metric_infos] == ["val/loss"]
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    hparams = {
        key: value.WhichOneof("kind") and getattr(value, value.WhichOneof("kind"))
        for key, value in start.hparams.items()
    }
    assert hparams["size"] == "tiny" and hparams["vocab_size"] == 300 and hparams["d_model"] == 32  # resolved
    assert hparams["max_steps"] == STEPS and hparams["tokens_per_step"] == TOKENS_PER_STEP and hparams["parameters"] > 0


@pytest.mark.slow
def test_samples_and_the_summary_are_text(two_runs):
    cwd, _ = two_runs
    events = _events(cwd, 1)
    samples = events.Tensors("sample/text_summary")
    assert [event.step for event in samples] == [event.step for event in events.Scalars("val/loss")]
    for event in samples:
        assert event.tensor_proto.string_val[0].decode().startswith(f"**{PROMPT}**")
    (summary,) = events.Tensors("summary/text_summary")
    assert summary.step == STEPS - 1 and "last.ckpt" in summary.tensor_proto.string_val[0].decode()


def test_default_run_draws_a_validation_curve():
    """Six points under TensorBoard's default smoothing hid where validation loss started and ended."""
    assert TRAINER_DEFAULTS["max_steps"] // TRAINER_DEFAULTS["val_check_interval"] >= 12
    default_yaml = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
    assert default_yaml["trainer"]["val_check_interval"] == TRAINER_DEFAULTS["val_check_interval"]
