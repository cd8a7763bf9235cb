"""GCFreeze: what is alive after the first step and after a validation is frozen during fit, and given back after."""

import gc

import lightning.pytorch as L
import pytest
from tiny_training import RandomTokenLM, fit

from callbacks import GCFreeze


def _frozen(obj: object) -> bool:
    """Frozen objects sit in the permanent generation, which ``gc.get_objects()`` leaves out."""
    return gc.is_tracked(obj) and not any(o is obj for o in gc.get_objects())


class _Watch(L.Callback):
    """Records, at the second step's end and the first validation's end, whether marker objects are frozen."""

    def __init__(self) -> None:
        self.before_training = ["made before fit"]
        self.seen: dict[str, bool] = {}

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if trainer.global_step == 1:
            self.made_in_step_one = ["made in step one"]
        if trainer.global_step == 2:
            self.seen["fit-time object, step 2"] = _frozen(self.before_training)
            self.seen["step-one object, step 2"] = _frozen(self.made_in_step_one)

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        self.made_in_validation = ["made in validation"]

    def on_validation_end(self, trainer, pl_module) -> None:
        self.seen.setdefault("validation object, after validation", _frozen(self.made_in_validation))


@pytest.mark.slow
def test_objects_alive_after_the_first_step_and_each_validation_are_frozen_until_teardown(tmp_path):
    assert gc.get_freeze_count() == 0
    watch = _Watch()
    fit(RandomTokenLM(), [GCFreeze(), watch], tmp_path, max_steps=4, val_batches=1, val_check_interval=3)
    assert watch.seen == {
        "fit-time object, step 2": True,  # alive at the first step's end
        "step-one object, step 2": False,  # made after it
        "validation object, after validation": True,  # GCFreeze's hook runs first: frozen by then
    }
    assert gc.get_freeze_count() == 0 and not _frozen(watch.before_training)


@pytest.mark.slow
def test_a_freeze_made_before_the_run_is_left_in_place(tmp_path):
    gc.freeze()
    try:
        frozen_before = gc.get_freeze_count()
        fit(RandomTokenLM(), [GCFreeze()], tmp_path, max_steps=2)
        assert gc.get_freeze_count() >= frozen_before > 0
    finally:
        gc.unfreeze()


class _Fail(L.Callback):
    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == 2:
            raise RuntimeError("failed mid-run")


@pytest.mark.slow
def test_a_run_that_fails_gives_its_objects_back(tmp_path):
    with pytest.raises(RuntimeError, match="failed mid-run"):
        fit(RandomTokenLM(), [GCFreeze(), _Fail()], tmp_path, max_steps=4)
    assert gc.get_freeze_count() == 0
