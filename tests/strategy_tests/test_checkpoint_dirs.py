"""Checkpoint directories (torch.distributed.checkpoint): a two-process zero3 run writes each epoch's checkpoint from
both ranks, in the background; it is read back whole, and resumed on one process under zero3, fsdp2, zero1,
bucketed_ddp and the default strategy, on the same two under fsdp2, zero1 and bucketed_ddp, and on four under zero3,
fsdp2 and zero1, each starting from exactly the state the two processes saved (compared with that state gathered by
zero3's own one-file path, bit for bit); consolidated into one file, which resumes too. A background save's host
buffers are made once, before the first save."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from checkpoint_dir_workers import RESUMED_ON_FOUR, RESUMED_ON_TWO, UnitsTinyLM, resume_on_four, save_under_zero3
from lightning.pytorch.callbacks import ModelCheckpoint
from strategy_workers import STEPS_PER_EPOCH, TinyData
from torch.distributed.tensor import DTensor

import strategies
from lm_systems.errors import RunError
from lm_systems.files import checkpoint_dir
from lm_systems.files.checkpoint_dir import is_checkpoint_dir, read_whole
from lm_systems.files.checkpoint_io import SafeCheckpointIO
from lm_systems.files.consolidate import main as consolidate_main
from lm_systems.files.host_staging import HostStager
from lm_systems.parallel import ShardedOptimizer
from lm_systems.run_callbacks.checkpoints import StepCheckpoint

SAVED_STEP = STEPS_PER_EPOCH  # the first epoch's checkpoint


@pytest.fixture(scope="module")
def saved(tmp_path_factory, spawn_two_ranks) -> Path:
    out_dir = tmp_path_factory.mktemp("zero3_directories")
    spawn_two_ranks(save_under_zero3, out_dir)
    return out_dir


def directory(out_dir: Path, step: int) -> Path:
    return out_dir / "ckpt" / f"epoch={step // STEPS_PER_EPOCH - 1}-step={step}.ckpt"


def full_state(out_dir: Path, step: int) -> dict:
    return torch.load(out_dir / f"full_step{step}.pt", weights_only=False)


def assert_equal_tensors(actual: dict, expected: dict, where: str) -> None:
    assert actual.keys() == expected.keys(), where
    for key, value in expected.items():
        assert torch.equal(actual[key], value), f"{where}[{key!r}] differs"


def assert_same_optimizer_state(actual: dict, expected: dict) -> None:
    assert actual["state"].keys() == expected["state"].keys()
    for index, state in expected["state"].items():
        assert_equal_tensors(actual["state"][index], state, f"optimizer state of parameter {index}")
    assert actual["param_groups"] == expected["param_groups"]


def test_each_rank_writes_its_own_files_and_the_directory_reads_back_whole(saved):
    for step in (SAVED_STEP, 2 * SAVED_STEP):
        path = directory(saved, step)
        assert is_checkpoint_dir(path)
        assert {p.name.split("_")[2] for p in path.glob("__*_*.distcp")} == {"0", "1"}, "both ranks wrote"
        whole, expected = read_whole(path), full_state(saved, step)
        assert whole["global_step"] == expected["global_step"] == step
        assert_equal_tensors(whole["state_dict"], expected["state_dict"], "state_dict")
        (optimizer,) = whole["optimizer_states"]
        assert_same_optimizer_state(optimizer, expected["optimizer"])
    assert not list((saved / "ckpt").glob("*.tmp-*")), "every temporary directory was renamed"


class StateAtTrainStart(L.Callback):
    """What the resumed run starts from, after Lightning restored the checkpoint: full weights and optimizer state."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        optimizer = trainer.optimizers[0]
        state = optimizer.local_state_dict() if isinstance(optimizer, ShardedOptimizer) else optimizer.state_dict()
        self.state_dict = {name: _full(value) for name, value in pl_module.state_dict().items()}
        self.optimizer = {
            "state": {i: {k: _full(v) for k, v in values.items()} for i, values in state["state"].items()},
            "param_groups": state["param_groups"],
        }
        self.global_step = trainer.global_step
        self.lr_scheduler = trainer.lr_scheduler_configs[0].scheduler.state_dict()


def _full(value: torch.Tensor) -> torch.Tensor:
    """A copy (on one process, a DTensor's full tensor is its local one, which training goes on to change)."""
    return (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()


@pytest.fixture
def one_process():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def resume(strategy, path: Path, tmp_path: Path) -> StateAtTrainStart:
    probe = StateAtTrainStart()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=SAVED_STEP + 1,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[probe],
        plugins=[SafeCheckpointIO()],
        default_root_dir=tmp_path,
        use_distributed_sampler=False,
    )
    trainer.fit(UnitsTinyLM(), datamodule=TinyData(), ckpt_path=str(path))
    assert trainer.global_step == SAVED_STEP + 1
    return probe


def assert_resumed_from(probe: StateAtTrainStart, expected: dict) -> None:
    assert probe.global_step == expected["global_step"]
    assert_equal_tensors(probe.state_dict, expected["state_dict"], "state_dict")
    assert_same_optimizer_state(probe.optimizer, expected["optimizer"])
    assert probe.lr_scheduler["last_epoch"] == expected["lr_scheduler"]["last_epoch"]


def assert_same_start(resumed: dict, expected: dict) -> None:
    """A resumed run's state at its start (as the workers keep it) against the full state the checkpoint was of."""
    assert resumed["global_step"] == expected["global_step"]
    assert_equal_tensors(resumed["state_dict"], expected["state_dict"], "state_dict")
    assert_same_optimizer_state(resumed["optimizer"], expected["optimizer"])


@pytest.mark.parametrize("strategy", ["zero3", "fsdp2", "zero1", "bucketed_ddp", "auto"])
def test_two_processes_directory_resumes_on_one_under_every_strategy(strategy, saved, tmp_path, one_process):
    probe = resume(strategy, directory(saved, SAVED_STEP), tmp_path)
    assert_resumed_from(probe, full_state(saved, SAVED_STEP))


@pytest.mark.parametrize("strategy", RESUMED_ON_TWO)
def test_two_processes_directory_resumes_on_two_under_other_strategies(strategy, saved):
    assert_same_start(torch.load(saved / f"{strategy}_start.pt", weights_only=False), full_state(saved, SAVED_STEP))


@pytest.fixture(scope="module")
def resumed_on_four(saved) -> Path:
    """The two processes' first-epoch directory resumed on four spawned processes (gloo) under RESUMED_ON_FOUR."""
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    mp.spawn(resume_on_four, args=(4, find_free_network_port(), str(saved)), nprocs=4, join=True)
    return saved


@pytest.mark.slow
@pytest.mark.parametrize("strategy", RESUMED_ON_FOUR)
def test_two_processes_directory_resumes_on_four(strategy, resumed_on_four):
    resumed = torch.load(resumed_on_four / f"{strategy}_on_four_start.pt", weights_only=False)
    assert_same_start(resumed, full_state(resumed_on_four, SAVED_STEP))


def test_consolidated_into_one_file_it_resumes_a_sharded_strategy(saved, tmp_path, one_process, capsys):
    out = tmp_path / "consolidated.ckpt"
    consolidate_main([str(directory(saved, SAVED_STEP)), str(out)])
    assert f"wrote {out}" in capsys.readouterr().out
    assert out.is_file() and not is_checkpoint_dir(out)
    probe = resume(strategies.Zero3Strategy(checkpoint_format="file"), out, tmp_path)
    assert_resumed_from(probe, full_state(saved, SAVED_STEP))


class RecordingStager(HostStager):
    """HostStager, noting the host address each ``stage`` copied each tensor into, by key."""

    staged: list[dict[str, int]] = []

    def stage(self, state_dict):
        staged = super().stage(state_dict)
        RecordingStager.staged.append({key: _local(value).data_ptr() for key, value in staged.items()})
        return staged


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


class StagedBeforeEachSave(L.Callback):
    """How many stagings were done when each checkpoint was asked for (before the strategy's save stages it)."""

    def __init__(self) -> None:
        self.staged_before: list[int] = []

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.staged_before.append(len(RecordingStager.staged))


def fit_under_zero3(tmp_path: Path, *callbacks: L.Callback, async_save: bool = True) -> None:
    """Four steps of the tiny model under zero3 in this process, checkpoints written as the callbacks say."""
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategies.Zero3Strategy(async_save=async_save),
        max_steps=4,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
        plugins=[SafeCheckpointIO()],
        default_root_dir=tmp_path,
        use_distributed_sampler=False,
    )
    trainer.fit(UnitsTinyLM(), datamodule=TinyData())


def test_host_buffers_are_made_before_the_first_save_and_each_save_only_copies_into_them(
    tmp_path, one_process, monkeypatch
):
    """The staging buffers of a background save exist before the loop's first save (made after the first optimizer
    step, once AdamW's state exists): every save copies into buffers an earlier staging made, none of its own."""
    monkeypatch.setattr(checkpoint_dir, "HostStager", RecordingStager)
    monkeypatch.setattr(RecordingStager, "staged", [])
    probe = StagedBeforeEachSave()
    fit_under_zero3(tmp_path, probe, ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1))
    assert is_checkpoint_dir(tmp_path / "epoch=0-step=4.ckpt")
    assert probe.staged_before == [1, 2], "one staging ahead of the saves at steps 2 and 4, then one for each"
    ahead, *saves = RecordingStager.staged
    assert {key.split("/")[0] for key in ahead} == {"model", "optimizer"}, "AdamW's state existed when staged ahead"
    for staged in saves:
        assert staged == ahead, "a save staged into buffers of its own"


def test_keep_removes_an_older_directory_only_once_a_newer_one_is_whole(tmp_path, one_process, monkeypatch):
    """StepCheckpoint(keep=2) under zero3: the newest two step directories stay, last.ckpt on the newest; each older
    one is removed only after the save that replaces it has been published."""
    whole_when_removed = []
    remove = strategies.Zero3Strategy._remove_now

    def recording_remove(self, filepath):
        newer = sorted(tmp_path.glob("step=*.ckpt"), key=lambda p: int(p.name[5:-5]))[-1]
        whole_when_removed.append((Path(filepath).name, newer.name, is_checkpoint_dir(newer)))
        remove(self, filepath)

    monkeypatch.setattr(strategies.Zero3Strategy, "_remove_now", recording_remove)
    fit_under_zero3(tmp_path, StepCheckpoint(1, dirpath=tmp_path, keep=2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "step=3.ckpt", "step=4.ckpt"]
    assert all(is_checkpoint_dir(tmp_path / f"step={n}.ckpt") for n in (3, 4))
    assert (tmp_path / "last.ckpt").resolve() == (tmp_path / "step=4.ckpt").resolve()
    assert whole_when_removed == [("step=1.ckpt", "step=3.ckpt", True), ("step=2.ckpt", "step=4.ckpt", True)]


@pytest.mark.parametrize("async_save", [True, False], ids=["in the background", "in the loop"])
def test_a_disk_that_cannot_hold_one_checkpoint_stops_the_run_at_its_first_step(
    tmp_path, one_process, monkeypatch, async_save
):
    """Known once AdamW's state exists (after the first optimizer step): a run whose checkpoints cannot fit stops
    then, in one line naming the bytes and the flags, instead of training up to its first save and failing there;
    whether it saves in the background or not."""
    monkeypatch.setattr(checkpoint_dir, "free_bytes", lambda folder: 1000)
    steps = []

    class Steps(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            steps.append(trainer.global_step)

    with pytest.raises(RunError) as error:
        fit_under_zero3(tmp_path, Steps(), StepCheckpoint(100, dirpath=tmp_path), async_save=async_save)
    message = str(error.value)
    assert "\n" not in message and "has 1,000 free" in message and "--trainer.enable_checkpointing false" in message
    assert steps == [], "stopped in the first step, before its batch ended"
    assert not list(tmp_path.glob("step=*")), "nothing written"
