"""At the door, the model is checked against the accelerator: a GPU-sized model on a CPU is warned about (naming
what it needs) before any data is prepared; the default tiny model is not. A CPU run leaves a core free unless
OMP_NUM_THREADS says otherwise."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from lm_systems.model.config import ModelConfig
from lm_systems.run.cpu_threads import TORCH_THREADS
from lm_systems.run.door_checks import CPU_MAX_PARAMETERS
from train import main

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI.s args parameter")  # pytest's own argv


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def built_warnings(args: list[str]) -> list[str]:
    """The warnings of parsing ``args`` and building the run (nothing trained)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main(args, run=False)
    return [str(w.message) for w in caught]


def parameters(size: str) -> int:
    """The size's parameter count at the size table's vocabulary, from its shape (embedding, LM head, per block:
    attention's four d×d matrices, SwiGLU's three d×d_ff, two norms; a final norm)."""
    c = ModelConfig.from_name(size)
    block = 4 * c.d_model**2 + 3 * c.d_model * c.d_ff + 2 * c.d_model
    return 2 * c.vocab_size * c.d_model + c.num_layers * block + c.d_model


def test_the_sizes_straddle_the_cpu_limit():
    assert parameters("tiny") < CPU_MAX_PARAMETERS < parameters("small")


def test_a_gpu_config_on_a_cpu_is_warned_about_before_the_data(tmp_path):
    said = built_warnings(
        [
            "-c",
            str(REPO / "configs" / "small.yaml"),
            "--accelerator",
            "cpu",
            "--data.cache_dir",
            str(tmp_path / "cache"),
        ]
    )
    expected = f"the model (--model.size small) has about {parameters('small') / 1e6:.0f}M parameters and trains on"
    assert any(message.startswith(expected) and "--accelerator gpu" in message for message in said), said
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache" / "tokens").glob("*"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default trains on the GPU there")
def test_the_default_config_is_not_warned_about(tmp_path):
    said = built_warnings(["-c", str(REPO / "configs" / "default.yaml"), "--data.cache_dir", str(tmp_path / "cache")])
    assert not any("trains on a CPU" in message for message in said), said


def test_a_cpu_run_leaves_a_core_free(monkeypatch, tmp_path):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(TORCH_THREADS)
    main(["--accelerator", "cpu", "--data.cache_dir", str(tmp_path / "cache")], run=False)
    assert torch.get_num_threads() == max(1, TORCH_THREADS - 1)


def test_omp_num_threads_chooses_the_cpu_threads(monkeypatch, tmp_path):
    monkeypatch.setenv("OMP_NUM_THREADS", str(TORCH_THREADS))
    torch.set_num_threads(TORCH_THREADS)
    main(["--accelerator", "cpu", "--data.cache_dir", str(tmp_path / "cache")], run=False)
    assert torch.get_num_threads() == TORCH_THREADS


def test_the_8b_leaderboard_config_on_a_cpu_is_refused_naming_the_override(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["-c", str(REPO / "configs" / "leaderboard_8b.yaml"), "--accelerator", "cpu"])
    assert exit_.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("error: --model.size 8b at 32,768 tokens a step needs about 1.6e+15 FLOPs a step"), line
    assert "--accelerator gpu" in line and "--cpu_step_limit_s" in line, line
    assert not (tmp_path / "logs").exists()


def test_the_step_time_limit_can_be_lifted(tmp_path):
    """The refusal's override: the check passes with a limit above the estimate, or none (0); small still warns."""
    from lm_systems.run.door_checks import check_model_fits_device

    small = main(["-c", str(REPO / "configs" / "small.yaml"), "--accelerator", "cpu"], run=False).config
    check_model_fits_device(small.model, "cpu", tokens_per_step=32_768 * 8, cpu_step_limit_s=0)
    with pytest.raises(ValueError, match="--cpu_step_limit_s 60"):
        check_model_fits_device(small.model, "cpu", tokens_per_step=32_768 * 8, cpu_step_limit_s=60)
