"""train.py runs CUDA with the allocator's expandable segments, unless the user set the allocator's settings."""

from __future__ import annotations

import os

import pytest

import train
from lm_systems.run.allocator import EXPANDABLE_SEGMENTS, allocator_setting


def test_a_cuda_build_gets_expandable_segments():
    assert allocator_setting({}, cuda_build=True) == ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


@pytest.mark.parametrize("name", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_the_users_own_settings_are_kept(name):
    assert allocator_setting({name: "max_split_size_mb:128"}, cuda_build=True) is None
    assert allocator_setting({name: ""}, cuda_build=True) is None  # set, even to nothing: their choice


def test_a_build_without_cuda_is_left_alone():
    assert allocator_setting({}, cuda_build=False) is None


def test_train_py_sets_it_before_building_the_run(monkeypatch):
    """main() sets it before it imports what could touch CUDA: here, with torch's build read as a CUDA one."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.setenv(name, "")  # restored (unset) after the test
        monkeypatch.delenv(name)
    monkeypatch.setattr("torch.version.cuda", "12.8")
    seen = {}
    monkeypatch.setattr("lm_systems.cli.main", lambda args, run, **parts: seen.update(os.environ))
    train.main([])
    assert seen["PYTORCH_CUDA_ALLOC_CONF"] == EXPANDABLE_SEGMENTS
