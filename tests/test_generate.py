"""Loading a training checkpoint for generation: unreadable files name --ckpt."""

import pytest

from lm_systems.generate import load_checkpoint


def test_unreadable_checkpoints_name_the_flag(tmp_path):
    with pytest.raises(FileNotFoundError, match="--ckpt"):
        load_checkpoint(tmp_path / "missing.ckpt")
    junk = tmp_path / "junk.ckpt"
    junk.write_text("not a checkpoint")
    with pytest.raises(ValueError, match="--ckpt"):
        load_checkpoint(junk)
