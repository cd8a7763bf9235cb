"""zero3 on two CPU processes (gloo) against single-process training on the same global batch: accumulation,
clipping by the global norm, LR schedule, validation, teardown, checkpoints resumed at world sizes 2 and 1;
and `python train.py --strategy zero3_spawn` end to end."""

from __future__ import annotations

import re

import pytest
import torch
from strategy_workers import (
    ACCUMULATE,
    ENGAGED_CLIP,
    EPOCHS,
    STEPS_PER_EPOCH,
    TinyData,
    TinyLM,
    epoch0_checkpoint,
    load_ranks,
    make_trainer,
    run_cpu_strategies,
    single_process_reference,
)

import strategies
from lm_systems.files.checkpoint_io import SafeCheckpointIO, read_checkpoint
from strategies.zero3 import resolve_compute_dtype

CLIP = ENGAGED_CLIP  # every step clips, by the norm over all ranks' shards (the other strategies' tests: never)


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("zero3")


@pytest.fixture(scope="module")
def reference(out_dir) -> dict:
    return single_process_reference(out_dir, CLIP)


@pytest.fixture(scope="module")
def runs(out_dir, spawn_two_ranks) -> dict[str, list[dict]]:
    spawn_two_ranks(run_cpu_strategies, out_dir, ["zero3"], CLIP)
    return {name: load_ranks(out_dir, name) for name in ("zero3", "zero3_resumed")}


def assert_state_close(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(
            actual[name], expected[name], atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}"
        )


def test_trains_like_one_process_on_the_global_batch(runs, reference):
    """Ranks start from different weights, accumulate 2 micro-batches, clip at 0.3 (by the global norm:
    each rank's own shards' norm would clip differently), follow the LR schedule."""
    assert min(reference["grad_norms"]) > CLIP, "every step clips"
    for rank in range(2):
        assert runs["zero3"][rank]["wrapper"] == "FullyShardedDataParallel"
        assert_state_close(runs["zero3"][rank]["final"], reference["final"])
        assert runs["zero3"][rank]["lrs"] == pytest.approx(reference["lrs"])
        assert runs["zero3"][rank]["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-5)


def test_accumulation_reduces_gradients_only_on_boundaries(runs):
    for rank in range(2):
        for batch_idx, calls in runs["zero3"][rank]["collectives_per_batch"]:
            boundary = (batch_idx + 1) % ACCUMULATE == 0
            assert (calls > 0) == boundary, f"batch {batch_idx}: {calls} collectives"


def test_teardown_removes_hooks_and_unwraps(runs):
    for rank in range(2):
        assert runs["zero3"][rank]["unwrapped"]
        assert runs["zero3"][rank]["module_hooks_left"] == 0


def test_checkpoint_holds_full_weights_and_the_plain_optimizer_state(runs, out_dir):
    saved = read_checkpoint(epoch0_checkpoint(out_dir, "zero3"))
    shapes = {name: value.shape for name, value in TinyLM().state_dict().items()}
    assert {name: value.shape for name, value in saved["state_dict"].items()} == shapes
    (optimizer_state,) = saved["optimizer_states"]
    trainable = [p for p in TinyLM().parameters() if p.requires_grad]
    assert len(optimizer_state["state"]) == len(trainable) == 2 + 1  # hidden weight and bias, the tied embedding
    for index, param in enumerate(trainable):
        assert optimizer_state["state"][index]["exp_avg"].shape == param.shape


def test_resumes_from_its_checkpoint_on_two_ranks(runs):
    """Stopped after epoch 0 and resumed from its checkpoint: the uninterrupted run's trajectory."""
    for rank in range(2):
        assert_state_close(runs["zero3_resumed"][rank]["final"], runs["zero3"][rank]["final"])
        assert runs["zero3_resumed"][rank]["lrs"] == pytest.approx(runs["zero3"][rank]["lrs"][STEPS_PER_EPOCH:])


def test_resumes_from_its_checkpoint_on_one_process_without_sharding(runs, out_dir):
    trainer = make_trainer(
        "auto", 1, str(out_dir), "resumed_single", clip=CLIP, enable_checkpointing=False, plugins=[SafeCheckpointIO()]
    )  # SafeCheckpointIO reads zero3's checkpoint directory whole
    trainer.fit(TinyLM(), datamodule=TinyData(), ckpt_path=str(epoch0_checkpoint(out_dir, "zero3")))
    (result,) = load_ranks(out_dir, "resumed_single", ranks=1)
    assert_state_close(result["final"], runs["zero3"][0]["final"])
    assert len(result["lrs"]) == STEPS_PER_EPOCH * (EPOCHS - 1)


def test_bad_compute_dtype_names_the_option():
    with pytest.raises(ValueError, match="--trainer.strategy.compute_dtype"):
        strategies.Zero3Strategy(compute_dtype="int8")


@pytest.mark.parametrize("prefetch", [-1, 1.5, True])
def test_bad_prefetch_names_the_option(prefetch):
    with pytest.raises(ValueError, match="--trainer.strategy.prefetch"):
        strategies.Zero3Strategy(prefetch=prefetch)


@pytest.mark.parametrize(
    "choice, precision, expected",
    [
        ("auto", "bf16-mixed", torch.bfloat16),
        ("auto", "bf16-true", torch.bfloat16),
        ("auto", "16-mixed", None),
        ("auto", "32-true", None),
        ("fp32", "bf16-mixed", None),
        ("bf16", "32-true", torch.bfloat16),
        ("fp16", "16-mixed", torch.float16),
    ],
)
def test_weights_are_gathered_in_bf16_under_bf16_precisions_unless_asked_otherwise(choice, precision, expected):
    """auto follows torch FSDP2's mixed-precision recipe (bf16 parameters under bf16); None: the masters' dtype."""
    assert resolve_compute_dtype(choice, precision) == expected


def test_train_py_trains_on_two_spawned_cpu_processes(tmp_path, train_py):
    """The tiny default through train.py: the loss falls, both ranks end with the same full weights, and the
    last checkpoint holds them (tests/test_train_py_two_processes.py replays zero3's popen-launched runs)."""
    done = train_py.run_ok(
        *train_py.tiny,
        "--strategy",
        "zero3_spawn",
        "--accelerator",
        "cpu",
        "--devices",
        "2",
        "--max_steps",
        "8",
        "--model.num_layers",
        "2",
        "--model.warmup_steps",
        "2",
        "--data.batch_size",
        "4",
        "--trainer.val_check_interval",
        "4",
        "--trainer.callbacks+=tests.strategy_tests.strategy_workers.LossAndWeights",
        f"--trainer.callbacks.out_dir={tmp_path}",
        cwd=tmp_path,
    )
    assert re.search(r"^finished +8 steps in ", done.stdout, re.MULTILINE), done.stdout[-2000:]  # the run's summary
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    losses = ranks[0]["losses"]
    assert len(losses) == 8 and sum(losses[-2:]) < sum(losses[:2]) - 0.2, losses
    for name, value in ranks[0]["final"].items():
        assert torch.equal(value, ranks[1]["final"][name]), name
    (checkpoint,) = tmp_path.rglob("step=8.ckpt")
    saved = read_checkpoint(checkpoint)
    for name, value in saved["state_dict"].items():  # full weights, as the unwrapped module holds them
        assert torch.equal(value, ranks[0]["final"][name]), name
