"""Checkpoint directories written by one process (gloo, world size 1): an asynchronous save is named, and linked as
the newest, only once whole, from a copy taken when it was asked for; a kill -9 mid-save leaves the previous
checkpoint named the newest, and a resume from it continues; a disk too small is refused before anything is
written; the files hold the state's bytes and little more."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import strategies
from lm_systems.errors import RunError
from lm_systems.files import checkpoint_dir, host_staging
from lm_systems.files.checkpoint_dir import CheckpointDirWriter, is_checkpoint_dir, read_whole
from lm_systems.files.checkpoint_io import SafeCheckpointIO
from lm_systems.run_callbacks.checkpoints import StepCheckpoint

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def group(single_rank_group):
    """A one-process default group, and the gloo group a writer coordinates its saves over."""
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=60))


def a_checkpoint(rows: int = 4) -> dict:
    generator = torch.Generator().manual_seed(0)
    weights = {f"layer{i}.weight": torch.randn(rows, 1024, generator=generator) for i in range(4)}
    state = {i: {"exp_avg": torch.randn(rows, 1024, generator=generator), "step": torch.tensor(3.0)} for i in range(4)}
    return {
        "global_step": 3,
        "state_dict": weights,
        "optimizer_states": [{"state": state, "param_groups": [{"lr": 0.1, "params": [0, 1, 2, 3]}]}],
    }


def copied(checkpoint: dict) -> dict:
    return {
        "state_dict": {k: v.clone() for k, v in checkpoint["state_dict"].items()},
        "optimizer": {
            i: {k: v.clone() for k, v in s.items()} for i, s in checkpoint["optimizer_states"][0]["state"].items()
        },
    }


def test_an_asynchronous_save_is_named_and_linked_only_once_whole(group, tmp_path, monkeypatch):
    release, finishing = threading.Event(), threading.Event()
    finish = FileSystemWriter.finish

    def held_finish(self, *args, **kwargs):  # every rank's data is written; the metadata is next
        finishing.set()
        assert release.wait(60)
        return finish(self, *args, **kwargs)

    monkeypatch.setattr(FileSystemWriter, "finish", held_finish)
    writer = CheckpointDirWriter(group, asynchronous=True)
    checkpoint = a_checkpoint()
    expected = copied(checkpoint)
    path, published = tmp_path / "step=3.ckpt", []
    writer.save(checkpoint, path)
    for tensor in checkpoint["state_dict"].values():
        tensor.add_(1.0)  # training goes on: the save holds the values it was asked for
    writer.when_published(path, lambda: published.append(path.exists()))
    assert finishing.wait(60)
    assert not path.exists() and not published, "named before whole"
    (temporary,) = tmp_path.glob("step=3.ckpt.tmp-*")
    release.set()
    writer.wait()
    assert published == [True] and is_checkpoint_dir(path) and not temporary.exists()
    whole = read_whole(path)
    assert whole["global_step"] == 3
    for name, value in expected["state_dict"].items():
        assert torch.equal(whole["state_dict"][name], value), name
    for index, state in expected["optimizer"].items():
        for key, value in state.items():
            assert torch.equal(whole["optimizer_states"][0]["state"][index][key], value), (index, key)


def test_one_writer_saves_sharded_state_again_and_again(group, tmp_path):
    """DTensor state (as zero3 and fsdp2 hand it over) through three asynchronous saves of one writer, each whole and
    from the values it was asked for (torch 2.11's DefaultStager failed a second save)."""
    mesh = init_device_mesh("cpu", (1,))
    checkpoint = a_checkpoint()
    checkpoint["state_dict"] = {k: DTensor.from_local(v, mesh, [Shard(0)]) for k, v in checkpoint["state_dict"].items()}
    writer = CheckpointDirWriter(group, asynchronous=True)
    writer.allocate_host_buffers(checkpoint)
    for step in (1, 2, 3):
        checkpoint["global_step"] = step
        expected = {k: v.to_local().clone() for k, v in checkpoint["state_dict"].items()}
        writer.save(checkpoint, tmp_path / f"step={step}.ckpt")
        for tensor in checkpoint["state_dict"].values():
            tensor.to_local().add_(1.0)
        writer.wait()
        whole = read_whole(tmp_path / f"step={step}.ckpt")
        assert whole["global_step"] == step
        for name, value in expected.items():
            assert torch.equal(whole["state_dict"][name], value), (step, name)


def test_a_dtensor_over_a_mesh_of_two_dimensions_is_refused_naming_the_mesh(group, tmp_path):
    """The host copy stands a DTensor on a one-dimensional mesh of every rank; any other layout would be written
    with the wrong offsets, so it is refused before anything is written."""
    mesh = init_device_mesh("cpu", (1, 1))
    checkpoint = a_checkpoint()
    checkpoint["state_dict"] = {
        k: DTensor.from_local(v, mesh, [Shard(0), Shard(0)]) for k, v in checkpoint["state_dict"].items()
    }
    with pytest.raises(
        ValueError, match=r"one mesh dimension of all ranks in order \(\[0\]\); got a mesh of shape \(1, 1\)"
    ):
        CheckpointDirWriter(group, asynchronous=True).save(checkpoint, tmp_path / "step=3.ckpt")
    assert list(tmp_path.iterdir()) == []


def test_a_save_that_fails_to_start_leaves_nothing_in_flight(group, tmp_path, monkeypatch):
    """An error raised by the save itself (not its background write) reaches the caller, and the next wait (the
    crash checkpoint's save) returns instead of waiting for a write that never began."""

    def broken(*args, **kwargs):
        raise KeyError(type)

    monkeypatch.setattr(checkpoint_dir.dcp, "async_save", broken)
    writer = CheckpointDirWriter(group, asynchronous=True)
    with pytest.raises(KeyError):
        writer.save(a_checkpoint(), tmp_path / "step=3.ckpt")
    waiting = threading.Thread(target=writer.wait, daemon=True)
    waiting.start()
    waiting.join(timeout=10)
    assert not waiting.is_alive(), "wait() hangs on a save that never started"
    assert list(tmp_path.iterdir()) == []


def test_the_files_hold_the_states_bytes_within_5_percent(group, tmp_path):
    checkpoint = a_checkpoint(rows=64)  # 2 MB of tensors
    own = sum(t.numel() * t.element_size() for t in checkpoint["state_dict"].values())
    own += sum(
        t.numel() * t.element_size() for s in checkpoint["optimizer_states"][0]["state"].values() for t in s.values()
    )
    CheckpointDirWriter(group, asynchronous=False).save(checkpoint, tmp_path / "step=3.ckpt")
    on_disk = sum(p.stat().st_size for p in (tmp_path / "step=3.ckpt").iterdir())
    assert own <= on_disk <= 1.05 * own, (on_disk, own)


def test_a_disk_too_small_is_refused_in_one_line_before_anything_is_written(group, tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_dir, "free_bytes", lambda path: 1000)
    with pytest.raises(RunError) as error:
        CheckpointDirWriter(group).save(a_checkpoint(), tmp_path / "step=3.ckpt")
    message = str(error.value)
    assert "\n" not in message
    assert f"needs {4 * 2 * 4 * 1024 * 4 + 4 * 4:,} bytes" in message and "has 1,000 free" in message, message
    assert "--trainer.default_root_dir" in message
    assert not list(tmp_path.iterdir()), "nothing written"


KILLED_MID_SAVE = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import lightning.pytorch as L
    from torch.distributed.checkpoint import FileSystemWriter
    import strategies
    from lm_systems.files.checkpoint_io import SafeCheckpointIO
    from lm_systems.run_callbacks.checkpoints import StepCheckpoint
    from random_windows import RandomWindowsLM

    folder, marker = Path(sys.argv[1]), Path(sys.argv[2])

    class StallTheSecondSave(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 2:  # before StepCheckpoint saves step 2: its data written, its metadata never
                finish = FileSystemWriter.finish
                def stalled(writer, *args, **kwargs):
                    if "step=2" not in str(writer.path):  # step 1's asynchronous save may still be finishing
                        return finish(writer, *args, **kwargs)
                    marker.touch()
                    time.sleep(600)
                FileSystemWriter.finish = stalled

    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategies.Zero3Strategy(), max_steps=4, logger=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[StallTheSecondSave(), StepCheckpoint(1, dirpath=str(folder))], plugins=[SafeCheckpointIO()],
    )
    trainer.fit(RandomWindowsLM())
    """
)


class StartStep(L.Callback):
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.step = trainer.global_step


@pytest.fixture
def killed_mid_save(tmp_path) -> Path:
    """The checkpoint folder of a zero3 run saving every step, killed (-9) while its step 2 was being written."""
    folder, marker = tmp_path / "checkpoints", tmp_path / "writing"
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_MID_SAVE, str(folder), str(marker)],
        env=environment,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert child.poll() is None, child.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the second save never started"
            time.sleep(0.2)
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        child.stderr.close()
    return folder


@pytest.mark.slow  # a run in a subprocess, then a resume
def test_a_kill_mid_save_leaves_the_previous_checkpoint_the_newest_and_a_resume_continues(killed_mid_save):
    folder = killed_mid_save
    assert os.readlink(folder / "last.ckpt") == "step=1.ckpt" and is_checkpoint_dir(folder / "step=1.ckpt")
    assert not (folder / "step=2.ckpt").exists(), "a partial checkpoint under its own name"
    (temporary,) = folder.glob("step=2.ckpt.tmp-*")
    an_hour_ago = time.time() - 3600
    os.utime(temporary, (an_hour_ago, an_hour_ago))
    start = StartStep()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategies.Zero3Strategy(),
        max_steps=3,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[start, StepCheckpoint(1, dirpath=str(folder))],
        plugins=[SafeCheckpointIO()],
    )
    from random_windows import RandomWindowsLM

    try:
        trainer.fit(RandomWindowsLM(), ckpt_path=str(folder / "last.ckpt"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert start.step == 1 and trainer.global_step == 3
    assert not temporary.exists(), "the killed save's directory is removed by the next run"
    assert os.readlink(folder / "last.ckpt") == "step=3.ckpt"
    assert read_whole(folder / "last.ckpt")["global_step"] == 3


def test_saving_a_step_again_replaces_its_directory_whole(group, tmp_path):
    """A run resumed into its own folder saves a step it saved before: the new checkpoint takes the name."""
    writer, path = CheckpointDirWriter(group, asynchronous=False), tmp_path / "step=3.ckpt"
    writer.save(a_checkpoint(), path)
    second = a_checkpoint()
    second["global_step"] = 4
    second["state_dict"]["layer0.weight"].fill_(7.0)
    writer.save(second, path)
    whole = read_whole(path)
    assert whole["global_step"] == 4 and bool((whole["state_dict"]["layer0.weight"] == 7.0).all())
    assert [p.name for p in tmp_path.iterdir()] == ["step=3.ckpt"], "no temporary left behind"


@pytest.mark.parametrize(
    "pinned",
    [False, pytest.param(True, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))],
)
def test_the_host_copy_holds_the_state_s_bytes_in_one_buffer_reused_until_a_shape_changes(group, pinned):
    """The staged tensors lie in one stretch of host memory as large as they are (each key's place rounded to 64
    bytes), not a power of two per tensor as torch's pinned allocator makes it, and each one's storage is its own
    bytes (DCP's writer copies a tensor whose storage is larger); a second staging copies into the same places; a
    changed shape gets new ones. On CUDA the memory is page-locked and the copies come from the GPU."""
    device = "cuda" if pinned else "cpu"
    state = {"w": torch.randn(1000, 3, device=device), "b": torch.arange(5, device=device), "s": torch.tensor(2.0)}
    stager = host_staging.HostStager(group, pinned=pinned)
    try:
        first = stager.stage(state)
        assert _span(first) == 12032 + 64 + 4  # 12,000 bytes in 188 places of 64, 40 in 1, then 4
        assert all(value.untyped_storage().nbytes() == value.nbytes for value in first.values())
        assert all(torch.equal(first[key], value.cpu()) for key, value in state.items())
        assert all(value.is_pinned() == pinned for value in first.values())
        addresses = {key: value.data_ptr() for key, value in first.items()}
        state["w"].add_(1.0)
        again = stager.stage(state)
        assert {key: value.data_ptr() for key, value in again.items()} == addresses
        assert torch.equal(again["w"], state["w"].cpu())
        state["w"] = torch.randn(7, device=device)
        changed = stager.stage(state)
        assert torch.equal(changed["w"], state["w"].cpu()) and _span(changed) == 64 + 64 + 4
    finally:
        stager.close()


def _span(staged: dict[str, torch.Tensor]) -> int:
    """The bytes from the first staged tensor's start to the last one's end."""
    return max(t.data_ptr() + t.nbytes for t in staged.values()) - min(t.data_ptr() for t in staged.values())


def test_after_pending_waits_for_the_save_in_flight_and_never_runs_if_it_fails(group, tmp_path, monkeypatch):
    """An older checkpoint is removed (after_pending) only once the newer one is whole: held while it is written,
    run once it is published, at once with nothing in flight, never when the newer save fails."""
    release, finishing = threading.Event(), threading.Event()
    finish = FileSystemWriter.finish
    fail = []

    def held_finish(self, *args, **kwargs):
        finishing.set()
        assert release.wait(60)
        if fail:
            raise OSError("the disk went away")
        return finish(self, *args, **kwargs)

    monkeypatch.setattr(FileSystemWriter, "finish", held_finish)
    writer = CheckpointDirWriter(group, asynchronous=True)
    ran = []
    writer.save(a_checkpoint(), tmp_path / "step=3.ckpt")
    writer.after_pending(lambda: ran.append((tmp_path / "step=3.ckpt").exists()))
    assert finishing.wait(60) and ran == []
    release.set()
    writer.wait()
    assert ran == [True], "run once the newer checkpoint was published"
    writer.after_pending(lambda: ran.append("at once"))
    assert ran == [True, "at once"]

    release.clear()
    fail.append(True)
    writer.save(a_checkpoint(), tmp_path / "step=4.ckpt")
    writer.after_pending(lambda: ran.append("after a failed save"))
    writer.when_published(tmp_path / "step=4.ckpt", lambda: ran.append("linked to a failed save"))
    release.set()
    assert writer._pending.done.wait(60)  # failed, not yet waited for: still the save in flight
    writer.after_pending(lambda: ran.append("asked after the failure"))
    writer.when_published(tmp_path / "step=4.ckpt", lambda: ran.append("named after the failure"))
    with pytest.raises(RuntimeError, match="the disk went away"):
        writer.wait()
    assert ran == [True, "at once"] and not (tmp_path / "step=4.ckpt").exists()


def hold_writes(monkeypatch) -> threading.Event:
    """Each save's write holds before its metadata until the returned event is set."""
    release = threading.Event()
    finish = FileSystemWriter.finish

    def held_finish(self, *args, **kwargs):
        assert release.wait(60)
        return finish(self, *args, **kwargs)

    monkeypatch.setattr(FileSystemWriter, "finish", held_finish)
    return release


def test_the_disk_check_waits_for_the_save_in_flight(group, tmp_path, monkeypatch):
    """Its collectives share the writer's group with the writing thread's: run beside them, two ranks may meet them
    in different orders and hang (a resumed run did, while it saved again the step it had resumed from)."""
    release = hold_writes(monkeypatch)
    writer = CheckpointDirWriter(group, asynchronous=True)
    path = tmp_path / "step=3.ckpt"
    writer.save(a_checkpoint(), path)
    check = threading.Thread(target=writer.check_room, args=(tmp_path, a_checkpoint()))
    check.start()
    check.join(1.0)
    assert check.is_alive(), "checked while the save was being written"
    release.set()
    check.join(60)
    assert not check.is_alive() and is_checkpoint_dir(path)


def test_a_collective_on_the_writers_group_during_a_save_is_an_error_not_a_hang(group, tmp_path, monkeypatch):
    release = hold_writes(monkeypatch)
    writer = CheckpointDirWriter(group, asynchronous=True)
    writer.save(a_checkpoint(), tmp_path / "step=3.ckpt")
    try:
        with pytest.raises(RuntimeError, match="while .*step=3.ckpt is written"):
            writer._room(tmp_path, 1)  # what check_room and save do after waiting for the save in flight
    finally:
        release.set()
        writer.wait()
