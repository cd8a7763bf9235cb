"""`python train.py --strategy S --accelerator cpu --devices 2` (gloo, Lightning's popen launcher re-running the
script, hence a subprocess) for each of our strategies, with gradient accumulation, clipping that engages at every
step and validation on (bucketed_ddp also compiled in runs of blocks that share a bucket):

- each rank's micro-batches, replayed in one process by a plain AdamW loop (tests/run_record.py), give the final
  weights and optimizer state of the run's last checkpoint, within float32 reduction-order bounds;
- for bucketed_ddp, zero1 and zero3, a run stopped at a checkpoint and resumed from it ends bit for bit where the
  uninterrupted run ended: weights, optimizer state, schedule and data position, on the same batches, with the same
  validation losses;
- the summary rank 0 prints counts every rank's tokens (the records' and a count from the batch shape) and its
  speed and MFU agree with them and with the model's FLOPs counted from its shape;
- SIGTERM (or Ctrl-C) to the run stops both processes after a crash checkpoint, exit status 143 (130);
- a rank that dies (kill -9 of either, an exception on one) stops the other within seconds, in one line naming it and
  the last whole checkpoint, from which the run resumes; under zero3, killed while a checkpoint directory is being
  written, it names the last whole one (never the one in flight) and the run resumed from it ends bit for bit where
  the uninterrupted run ended.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
import torch
from run_record import load_records, replay
from sigterm_run import (
    FAILURES,
    rank_1_killed_mid_save,
    rank_dies_after_first_checkpoint,
    sigterm_after_first_checkpoint,
)

from lm_systems.files.checkpoint_io import read_checkpoint

STEPS, STOP_AT, ACCUMULATE = 6, 3, 2
PEAK_FLOPS = 1e6  # far below what a CPU reaches: the MFU prints (to 0.1%) in the thousands of %, 5 digits
# Below every step's gradient norm in these runs (0.6-0.7 measured), so every step clips: a strategy whose
# wrapper skipped or misplaced clipping would end elsewhere. The replay asserts that each step clipped.
CLIP = "0.25"
RUN = [
    "--accelerator",
    "cpu",
    "--devices",
    "2",
    "--max_steps",
    str(STEPS),
    "--accumulate_grad_batches",
    str(ACCUMULATE),
    "--trainer.gradient_clip_val",
    CLIP,
    "--model.warmup_steps",
    "1",
    "--trainer.val_check_interval",
    "4",
    "--checkpointing_interval",
    str(STOP_AT),
    "--trainer.logger",
    "false",
    # A peak for the CPU, so the summary prints an MFU to check (train.py's own MFUMonitor, replaced, knows none).
    "--trainer.callbacks+=callbacks.MFUMonitor",
    f"--trainer.callbacks.peak_flops_per_s={PEAK_FLOPS}",
]


ZERO1_ALL_REDUCE = "zero1 --trainer.strategy.grad_reduce all_reduce"  # every rank keeps all averaged gradients
RESUMED = ["bucketed_ddp", "zero1", "zero3", ZERO1_ALL_REDUCE]
# RESUMED first, at the same positions in both lists: pytest keys a module-scoped parameter by its position, and
# then runs each strategy's uninterrupted run once for both tests.
FUSED = "--trainer.callbacks+=tests.fused_adamw.FusedAdamWOnCPU"  # fused AdamW clips inside its step
# Three blocks in three buckets of 80 kB: compiled as a run of two blocks (one graph) and one of one.
COMPILED_RUNS = "bucketed_ddp --model.compile buckets --model.num_layers 3 --trainer.strategy.bucket_size_mb 0.08"
ZERO3_PREFETCH_2 = f"zero3 {FUSED} --trainer.strategy.prefetch 2"  # all-gathers started two units ahead
# The leaderboard step's recipe, scaled down: each block recomputed in backward, the fused loss, synthetic tokens.
ZERO3_RECOMPUTED = "zero3 --model.activation_checkpointing blocks --data.synthetic true"
BUCKETED_SELECTIVE = "bucketed_ddp --model.activation_checkpointing selective"
STRATEGIES = [
    *RESUMED,
    "naive_ddp",
    "overlap_ddp",
    f"bucketed_ddp {FUSED}",
    ZERO3_PREFETCH_2,
    COMPILED_RUNS,
    ZERO3_RECOMPUTED,
    BUCKETED_SELECTIVE,
]


@pytest.fixture(scope="module")
def uninterrupted(strategy, train_py, tmp_path_factory) -> Path:
    """The whole run, checkpointing at STOP_AT and at the end; its records in the run folder."""
    run_dir = tmp_path_factory.mktemp(f"{strategy.split()[0]}_uninterrupted")
    done = train_py.run_ok(*train_py.tiny, *RUN, "--strategy", *strategy.split(), *record_into(run_dir), cwd=run_dir)
    (run_dir / "train_py.log").write_text(done.stdout + done.stderr)
    return run_dir


def record_into(run_dir: Path) -> list[str]:
    return ["--trainer.callbacks+=tests.run_record.RecordRun", f"--trainer.callbacks.out_dir={run_dir}"]


def checkpoint(run_dir: Path, step: int) -> dict:
    (path,) = run_dir.rglob(f"step={step}.ckpt")
    return read_checkpoint(path)


@pytest.mark.parametrize("strategy", STRATEGIES, scope="module")
def test_two_processes_train_like_one_process_on_their_batches(strategy, uninterrupted):
    records = load_records(uninterrupted)
    assert len(records) == 2 and not torch.equal(records[0]["batches"][0], records[1]["batches"][0]), (
        "ranks' data differ"
    )
    reference = replay(records)
    assert min(reference["grad_norms"]) > float(CLIP), ("every step clips", reference["grad_norms"])
    saved = checkpoint(uninterrupted, STEPS)
    assert saved["global_step"] == STEPS
    # Compiled kernels reassociate float32 sums: up to 2e-4 relative (7.7e-6 absolute) apart after 6 steps, measured.
    rtol, atol = (4e-4, 2e-5) if strategy == COMPILED_RUNS else (1e-4, 1e-6)
    for name, value in reference["state_dict"].items():
        assert not torch.equal(value, records[0]["initial"][name]), f"{name} never moved"
        # float32 throughout: per-rank means averaged vs one mean over the global batch differ by a few ulps per
        # gradient element, grown over 6 AdamW steps; clipping at the wrong norm moves weights by ~1e-3.
        torch.testing.assert_close(
            saved["state_dict"][name], value, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}"
        )
        for record in records:  # each rank's replica, as it ended
            assert torch.equal(record["final"][name], saved["state_dict"][name]), name
    if strategy == COMPILED_RUNS:
        assert "the 3 blocks compiled in 2 runs of 2, 1" in (uninterrupted / "train_py.log").read_text()
    (optimizer_state,) = saved["optimizer_states"]
    assert {group["fused"] for group in optimizer_state["param_groups"]} == {FUSED in strategy}
    expected = reference["optimizer"]
    assert optimizer_state["state"].keys() == expected["state"].keys()
    for index, state in expected["state"].items():
        assert int(optimizer_state["state"][index]["step"]) == STEPS
        for moment in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                optimizer_state["state"][index][moment],
                state[moment],
                rtol=rtol,
                atol=atol * state[moment].abs().max().item(),
                msg=lambda m, index=index, moment=moment: f"parameter {index}'s {moment}: {m}",
            )
    assert [g["lr"] for g in optimizer_state["param_groups"]] == pytest.approx(
        [g["lr"] for g in expected["param_groups"]]
    )


def summary_of(log: str) -> dict[str, str]:
    """The key → value lines of the summary a run ends with (``RunSummary``: the key padded to 11 characters)."""
    lines = log[log.rindex("\nfinished ") :].strip().splitlines()
    return {line[:11].strip(): line[12:] for line in lines}


def flops_per_token(config: dict) -> float:
    """Training FLOPs a token, counted by hand from the model's shape: 6 × the matmul weights (attention's q, k, v
    and output, the SwiGLU's three, the LM head) and causal attention's 6 · layers · T · d_model."""
    d, layers, context = config["d_model"], config["num_layers"], config["context_length"]
    matmul_weights = layers * (4 * d * d + 3 * d * config["d_ff"]) + config["vocab_size"] * d
    return 6.0 * matmul_weights + 6.0 * layers * context * d


@pytest.mark.parametrize("strategy", RESUMED[:1], scope="module")
def test_the_summary_counts_every_ranks_tokens_and_the_mfu_each_devices(strategy, uninterrupted):
    """Tokens and tokens/s are the whole run's, both ranks' together; MFU is a device's FLOPs over its own peak."""
    summary, records = summary_of((uninterrupted / "train_py.log").read_text()), load_records(uninterrupted)
    config = records[0]["config"]
    batch_tokens = 2 * config["context_length"]  # --data.batch_size 2 (tests/conftest.py's TINY)
    step_tokens = batch_tokens * ACCUMULATE * 2  # micro-batches a step, two ranks
    trained = sum(batch[:, 1:].numel() for record in records for batch in record["batches"])
    assert trained == STEPS * step_tokens
    assert summary["tokens"] == f"{trained:,} ({step_tokens:,} a step)"
    speed = re.fullmatch(
        r"([\d,]+) tokens/s, ([\d.e-]+) s a step \(after step 1, validation left out\)", summary["speed"]
    )
    tokens_per_s, seconds_a_step = float(speed[1].replace(",", "")), float(speed[2])
    assert tokens_per_s * seconds_a_step == pytest.approx(step_tokens, rel=0.01)  # s a step: 3 digits
    mfu = re.fullmatch(r"([\d.,]+)% of 0 TFLOP/s per device", summary["MFU"])
    device_flops_a_step = flops_per_token(config) * batch_tokens * ACCUMULATE
    assert float(mfu[1].replace(",", "")) / 100 == pytest.approx(
        device_flops_a_step / seconds_a_step / PEAK_FLOPS, rel=0.01
    )


@pytest.mark.parametrize("strategy", RESUMED, scope="module")
def test_resumed_run_ends_exactly_where_the_uninterrupted_one_did(
    strategy, uninterrupted, train_py, tmp_path, assert_same_training_state
):
    (stop,) = uninterrupted.rglob(f"step={STOP_AT}.ckpt")
    train_py.run_ok(
        *train_py.tiny,
        *RUN,
        "--strategy",
        *strategy.split(),
        "--ckpt_path",
        str(stop),
        *record_into(tmp_path),
        cwd=tmp_path,
    )
    whole, resumed = checkpoint(uninterrupted, STEPS), checkpoint(tmp_path, STEPS)
    assert_same_training_state(resumed, whole)
    assert whole["global_step"] == STEPS and whole["LMDataModule"] == {"train_batches_consumed": STEPS * ACCUMULATE}

    whole_records, resumed_records = load_records(uninterrupted), load_records(tmp_path)
    for rank, (before, after) in enumerate(zip(whole_records, resumed_records, strict=True)):
        assert after["start_step"] == STOP_AT
        continued = before["batches"][STOP_AT * ACCUMULATE :]
        assert len(after["batches"]) == len(continued), rank
        for index, (a, b) in enumerate(zip(after["batches"], continued, strict=True)):
            assert torch.equal(a, b), f"rank {rank}: micro-batch {STOP_AT * ACCUMULATE + index} differs"
        resumed_validations = [(step, loss) for step, loss in before["val_losses"] if step > STOP_AT]
        assert after["val_losses"] == resumed_validations and resumed_validations, rank


@pytest.mark.parametrize(
    ("strategy", "signum"),
    [("bucketed_ddp", signal.SIGTERM), ("fsdp2", signal.SIGTERM), ("zero3", signal.SIGINT)],
    ids=["bucketed_ddp-SIGTERM", "fsdp2-SIGTERM", "zero3-Ctrl-C"],
)
def test_sigterm_or_ctrl_c_to_the_launched_run_stops_both_ranks_after_a_crash_checkpoint(
    strategy, signum, train_py, tmp_path
):
    sigterm_after_first_checkpoint(train_py, tmp_path, *train_py.tiny, *RUN, "--strategy", strategy, signum=signum)


@pytest.mark.parametrize("failure", FAILURES)
def test_a_rank_that_dies_stops_the_run_in_one_line_naming_it_and_the_checkpoint(failure, train_py, tmp_path):
    # A short process-group timeout: a survivor left waiting in a collective would fail the test, not hang it.
    rank_dies_after_first_checkpoint(
        train_py,
        tmp_path,
        failure,
        *train_py.tiny,
        *RUN,
        "--strategy",
        "bucketed_ddp",
        "--trainer.strategy.timeout",
        "0:01:00",
    )


@pytest.mark.parametrize("strategy", ["zero3"], scope="module")
def test_a_rank_killed_mid_save_names_the_last_whole_directory_and_the_run_resumes_from_it(
    strategy, uninterrupted, train_py, tmp_path, assert_same_training_state
):
    run = [*train_py.tiny, *RUN, "--strategy", strategy]
    named = rank_1_killed_mid_save(train_py, tmp_path, *run, "--trainer.strategy.timeout", "0:01:00")
    assert read_checkpoint(named)["global_step"] < STEPS
    train_py.run_ok(*run, "--ckpt_path", str(named), cwd=tmp_path)
    assert_same_training_state(checkpoint(tmp_path, STEPS), checkpoint(uninterrupted, STEPS))
