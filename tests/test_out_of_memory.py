"""CUDA out of memory ends train.py in one line with exit status 1, saying where it ran out and what to change in the
run's terms; a crash checkpoint only of whole weights, with the same advice; --debug keeps the traceback. The error is
injected on the CPU at each place: the training step's forward and backward, validation, the optimizer's step."""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch

from lm_systems.errors import DEBUG_ENV
from lm_systems.model.transformer import TransformerLM
from lm_systems.training.out_of_memory import OutOfMemory, RunTerms, what_to_change
from train import main

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI.s args parameter")  # pytest's own argv
QUIET = ["--trainer.enable_model_summary", "false", "--trainer.enable_progress_bar", "false"]
NO_VALIDATION = ["--trainer.limit_val_batches", "0"]


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(DEBUG_ENV, "")  # restored after a test that sets it (--debug)


def out_of_memory() -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (the allocator's advice follows)")


def run_out_of_memory_at(monkeypatch, place: str, step: int) -> None:
    """torch's out-of-memory error raised at ``place`` in the optimizer step ``step`` (counting from 0; validation:
    its first batch)."""
    if place in ("forward", "validation"):
        forward = TransformerLM.forward

        def failing_forward(self, *args, **kwargs):
            training = torch.is_grad_enabled()
            if training == (place == "forward") and (not training or self._calls == step):
                raise out_of_memory()
            self._calls = getattr(self, "_calls", 0) + training
            return forward(self, *args, **kwargs)

        monkeypatch.setattr(TransformerLM, "_calls", 0, raising=False)
        monkeypatch.setattr(TransformerLM, "forward", failing_forward)
    elif place == "backward":
        backward = L.LightningModule.backward

        def failing_backward(self, *args, **kwargs):
            if self.trainer.global_step == step:
                raise out_of_memory()
            return backward(self, *args, **kwargs)

        monkeypatch.setattr(L.LightningModule, "backward", failing_backward)
    else:
        adamw_step = torch.optim.AdamW.step

        def failing_step(self, closure=None):
            if self._step_count_here == step:
                closure()  # the forward and backward ran; the update itself runs out
                raise out_of_memory()
            self._step_count_here += 1
            return adamw_step(self, closure)

        monkeypatch.setattr(torch.optim.AdamW, "_step_count_here", 0, raising=False)
        monkeypatch.setattr(torch.optim.AdamW, "step", failing_step)


def one_line_exit_1(args: list[str], capsys) -> tuple[str, str]:
    """The error line of ``main(args)``, which must exit with 1 and print no traceback; and all it printed."""
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 1
    captured = capsys.readouterr()
    printed = captured.out + captured.err
    assert "Traceback" not in printed, printed
    errors = [line for line in captured.err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0] == captured.err.strip().splitlines()[-1], captured.err
    return errors[0], printed


PLACES = {
    "forward": "in the training step's forward",
    "backward": "in the training step's backward",
    "optimizer": "in the optimizer's step",
    "validation": "in validation",
}


@pytest.mark.parametrize("place", list(PLACES))
def test_out_of_memory_is_one_line_saying_where_and_what_to_change(place, monkeypatch, capsys, tiny_args):
    run_out_of_memory_at(monkeypatch, place, step=0)
    validation = ["--trainer.limit_val_batches", "1"] if place == "validation" else NO_VALIDATION
    line, _ = one_line_exit_1([*tiny_args, *QUIET, *validation, "--max_steps", "2"], capsys)
    assert line.startswith(f"error: CUDA out of memory {PLACES[place]} at step 0: no CUDA memory statistics on cpu;")
    assert "change one of: a smaller --data.batch_size (now 2) or --model.context_length (now 16)" in line, line
    assert "--model.activation_checkpointing keep_projections (now none)" in line, line
    assert "--debug true" in line and "allocator's advice" not in line, line
    assert ("no checkpoint of weights" in line) == (place == "optimizer"), line


@pytest.mark.slow  # trains two steps and saves three checkpoints
@pytest.mark.parametrize("place, crash_saved", [("backward", True), ("optimizer", False)])
def test_a_crash_checkpoint_only_of_whole_weights_names_the_changes(
    place, crash_saved, monkeypatch, capsys, caplog, tmp_path, tiny_args
):
    run_out_of_memory_at(monkeypatch, place, step=2)
    one_line_exit_1([*tiny_args, *QUIET, *NO_VALIDATION, "--checkpointing_interval", "1"], capsys)
    checkpoints = tmp_path / "logs" / "lm_systems" / "version_0" / "checkpoints"
    assert (checkpoints / "crash.ckpt").exists() == crash_saved
    assert (checkpoints / "last.ckpt").resolve().name == "step=2.ckpt"  # the last good one, kept
    if crash_saved:
        resume = [text for text in caplog.messages if "resume with --ckpt_path" in text]  # Lightning's info line
        assert resume and "crash.ckpt, change one of: a smaller --data.batch_size (now 2)" in resume[0], caplog.text
        assert "--model.activation_checkpointing keep_projections (now none)" in resume[0]


def test_debug_keeps_the_traceback(monkeypatch, tiny_args):
    run_out_of_memory_at(monkeypatch, "backward", step=0)
    with pytest.raises(OutOfMemory, match="in the training step's backward") as raised:
        main([*tiny_args, *QUIET, *NO_VALIDATION, "--max_steps", "1", "--debug", "true"])
    assert isinstance(raised.value.__cause__, torch.OutOfMemoryError)


def terms(**changes) -> RunTerms:
    base = dict(
        batch_size=1,
        context_length=32768,
        activation_checkpointing="keep_attention",
        memory_budget=0.9,
        strategy="single_device",
        rank=0,
        world_size=1,
        step=3,
    )
    return RunTerms(**{**base, **changes})


def test_the_advice_follows_the_run():
    alone = what_to_change(terms(), gpus=1)
    assert "--model.activation_checkpointing blocks (now keep_attention)" in alone and "zero3" not in alone
    assert "memory_budget" not in alone
    budget = what_to_change(terms(activation_checkpointing="auto", memory_budget=0.8), gpus=1)
    assert (
        "a lower --model.memory_budget (now 0.8)" in budget and "activation_checkpointing blocks (now auto)" in budget
    )
    frugal = what_to_change(terms(activation_checkpointing="blocks"), gpus=1)
    assert "activation_checkpointing" not in frugal  # nothing keeps less
    hosts = what_to_change(terms(strategy="bucketed_ddp", world_size=8), gpus=8)
    assert "--trainer.strategy zero3 --trainer.devices 8 (now bucketed_ddp on 8)" in hosts
    assert "zero3" not in what_to_change(terms(strategy="fsdp2", world_size=8), gpus=8)


def test_a_rank_of_several_is_named():
    error = OutOfMemory("the training step's backward", terms(rank=1, world_size=2), "peak …", "change one of: …", True)
    assert str(error).startswith("CUDA out of memory in the training step's backward on rank 1 of 2 at step 3: peak")
    assert error.resume_advice == "change one of: …"
