"""Kernel tests take each Triton kernel's first config: on a GPU, compiling and timing every autotune
candidate for every test shape would cost more than the tests (tests that check the autotuned
configs turn it back on)."""

import pytest


@pytest.fixture(autouse=True)
def _first_autotune_config(monkeypatch):
    monkeypatch.setenv("LM_SYSTEMS_FLASH_AUTOTUNE", "0")
