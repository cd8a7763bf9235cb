"""`python train.py --strategy S --accelerator cpu --devices 4` (gloo, Lightning's popen launcher starting ranks 1-3)
for bucketed_ddp, zero1 and zero3, with gradient accumulation, clipping that engages at every step and validation on:

- the four ranks' micro-batches, replayed in one process (tests/run_record.py), give the last checkpoint's weights
  and AdamW moments, and all four replicas end equal to them;
- bucketed_ddp on one host picks its one-host bucket cap (tests/test_two_hosts.py checks the cap across hosts);
- zero3, whose shards are quarters here, resumed from a step checkpoint ends bit for bit where the uninterrupted
  run ended, with the same validation losses after the resume.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from replay_check import assert_trained_like_replay, last_checkpoint
from run_record import load_records
from test_train_py_two_processes import CLIP, checkpoint, record_into

from lm_systems.parallel.bucketed import ONE_HOST_BUCKET_MB

STEPS, STOP_AT = 4, 2
# Four ranks of batch 2 need 8 validation windows: two batches.
TRAINING = [
    "--accelerator",
    "cpu",
    "--max_steps",
    str(STEPS),
    "--accumulate_grad_batches",
    "2",
    "--trainer.gradient_clip_val",
    CLIP,
    "--model.warmup_steps",
    "1",
    "--trainer.val_check_interval",
    "2",
    "--data.val_batches",
    "2",
    "--checkpointing_interval",
    str(STOP_AT),
    # The plain loss, as the replay computes it: the fused loss sums in another order, which AdamW turns into
    # ~1e-6 moves of weights whose gradient is near zero (tests/test_train_py_two_processes.py covers it).
    "--model.fused_loss",
    "false",
]
RUN = [*TRAINING, "--devices", "4", "--trainer.logger", "false"]
RESUMED = "zero3"


@pytest.fixture(scope="module")
def uninterrupted(strategy, train_py, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp(f"{strategy}_four")
    done = train_py.run_ok(*train_py.tiny, *RUN, "--strategy", strategy, *record_into(run_dir), cwd=run_dir)
    (run_dir / "train_py.log").write_text(done.stdout + done.stderr)
    return run_dir


@pytest.mark.parametrize("strategy", [RESUMED, "bucketed_ddp", "zero1"], scope="module")
def test_four_processes_train_like_one_process_on_their_batches(strategy, uninterrupted):
    assert "MEMBER: 4/4" in (uninterrupted / "train_py.log").read_text()
    assert_trained_like_replay(uninterrupted, world_size=4, clip=float(CLIP))
    if strategy == "bucketed_ddp":
        assert f"of at most {ONE_HOST_BUCKET_MB:g} MB" in (uninterrupted / "train_py.log").read_text()


@pytest.mark.parametrize("strategy", [RESUMED], scope="module")
def test_resumed_four_process_run_ends_where_the_uninterrupted_one_did(
    strategy, uninterrupted, train_py, tmp_path, assert_same_training_state
):
    stop = next(uninterrupted.rglob(f"step={STOP_AT}.ckpt"))
    train_py.run_ok(
        *train_py.tiny, *RUN, "--strategy", strategy, "--ckpt_path", str(stop), *record_into(tmp_path), cwd=tmp_path
    )
    assert_same_training_state(last_checkpoint(tmp_path), checkpoint(uninterrupted, STEPS))
    for before, after in zip(load_records(uninterrupted), load_records(tmp_path), strict=True):
        assert after["start_step"] == STOP_AT
        resumed_validations = [(step, loss) for step, loss in before["val_losses"] if step > STOP_AT]
        assert after["val_losses"] == resumed_validations and resumed_validations
