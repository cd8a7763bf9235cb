"""Kernel tests take each Triton kernel's first config: on a GPU, compiling and timing every autotune
candidate for every test shape would cost more than the tests (tests that check the autotuned
configs turn it back on). Tuned choices go to a fresh folder per test, never the user's cache."""

import pytest

from lm_systems.attention.tuning import CACHE_ENV


@pytest.fixture(autouse=True)
def _first_autotune_config(monkeypatch):
    monkeypatch.setenv("LM_SYSTEMS_FLASH_AUTOTUNE", "0")


@pytest.fixture(autouse=True)
def tuning_cache_dir(monkeypatch, tmp_path):
    """The folder of this test's tuning cache."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "triton_tuning"))
    return tmp_path / "triton_tuning"
