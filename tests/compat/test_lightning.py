"""Each adapter of lm_systems.compat.lightning against the installed Lightning: a failure names the private name a
new Lightning release moved, so the adapter (and only it) is what to change."""

from __future__ import annotations

import contextlib
import inspect
import os
import signal

import lightning
import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar, ThroughputMonitor
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader

from lm_systems.compat import lightning as compat


def broken(name: str) -> str:
    return f"lightning {lightning.__version__} moved or changed {name}: update lm_systems/compat/lightning.py"


def private_method(cls: type, name: str) -> None:
    assert callable(getattr(cls, name, None)), broken(f"{cls.__name__}.{name}")


def called_in(cls: type, caller: str, name: str) -> None:
    """``cls.caller`` still calls ``self.name`` (so an override of ``name`` still takes effect)."""
    uses(cls, caller, f"self.{name}(")


def uses(cls: type, method: str, text: str) -> None:
    assert text in inspect.getsource(getattr(cls, method)), broken(f"{cls.__name__}.{method} using {text!r}")


class Recorder(L.LightningModule):
    """A linear model that records, per training batch, what the adapters answer."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.answers: list[tuple[int, bool, bool]] = []

    def training_step(self, batch, batch_idx):
        self.answers.append(
            (batch_idx, compat.logs_this_step(self.trainer), compat.accumulates_this_batch(self.trainer))
        )
        return self.layer(batch).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(torch.randn(16, 2), batch_size=2)


def fit(**kwargs) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )
    trainer.fit(Recorder())
    return trainer


def test_logs_this_step_and_accumulates_this_batch_follow_the_trainer():
    trainer = fit(max_steps=4, log_every_n_steps=2, accumulate_grad_batches=2)
    answers = trainer.lightning_module.answers
    # Batches 0..7, two per optimizer step: steps 0..3; Lightning logs steps 1 and 3 (every 2nd) and the last.
    assert [accumulating for _, _, accumulating in answers] == [True, False] * 4, broken("fit_loop._should_accumulate")
    assert [logs for _, logs, _ in answers] == [False, False, True, True, False, False, True, True], broken(
        "trainer._logger_connector.should_update_logs"
    )


def test_compute_dtype_is_the_precision_plugins():
    assert compat.compute_dtype(L.Trainer(accelerator="cpu", precision="bf16-mixed", logger=False)) == torch.bfloat16, (
        broken("callbacks.throughput_monitor._plugin_to_compute_dtype")
    )
    assert compat.compute_dtype(L.Trainer(accelerator="cpu", precision="32-true", logger=False)) == torch.float32


def test_is_local_path_tells_local_from_remote(tmp_path):
    assert compat.is_local_path(tmp_path) and compat.is_local_path("relative/file.ckpt"), broken(
        "_is_local_file_protocol"
    )
    assert not compat.is_local_path("s3://bucket/file.ckpt")


def test_attached_trainer_is_none_until_a_trainer_holds_the_module():
    module = Recorder()
    assert compat.attached_trainer(module) is None, broken("LightningModule._trainer")
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    assert compat.attached_trainer(module) is trainer, broken("LightningModule._trainer")


def test_optimizer_to_device_moves_the_state():
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.AdamW([param])
    param.grad = torch.ones(2)
    optimizer.step()
    compat.optimizer_to_device(optimizer, torch.device("meta"))
    assert all(v.device.type == "meta" for v in optimizer.state[param].values() if v.dim()), broken(
        "fabric.utilities.optimizer._optimizer_to_device"
    )


def test_the_cli_base_skips_lightnings_checkpoint_hyperparameter_parsing():
    private_method(LightningCLI, "_parse_ckpt_path")
    called_in(LightningCLI, "__init__", "_parse_ckpt_path")


def fit_with_checkpoint(checkpoint: ModelCheckpoint, max_steps: int) -> None:
    L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=False,
        callbacks=[checkpoint],
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(Recorder())


def test_the_checkpoint_base_reaches_modelcheckpoints_save_and_link_steps(tmp_path):
    for name in (
        "_should_skip_saving_checkpoint",
        "_monitor_candidates",
        "_save_topk_checkpoint",
        "_save_last_checkpoint",
        "_link_checkpoint",
    ):
        private_method(ModelCheckpoint, name)
    called_in(ModelCheckpoint, "_save_last_checkpoint", "_link_checkpoint")
    links = []

    class Recording(compat.LinkingModelCheckpoint):
        def link_checkpoint(self, trainer, filepath, linkpath):
            links.append((os.path.basename(filepath), os.path.basename(linkpath)))
            super().link_checkpoint(trainer, filepath, linkpath)

    class SavesAtEnd(Recording):
        def on_train_end(self, trainer, pl_module):
            self.save_step(trainer)

    checkpoint = SavesAtEnd(
        dirpath=tmp_path,
        filename="step={step}",
        save_top_k=-1,
        save_last="link",
        every_n_train_steps=2,
        auto_insert_metric_name=False,
    )
    fit_with_checkpoint(checkpoint, max_steps=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "step=2.ckpt", "step=3.ckpt"], broken(
        "ModelCheckpoint's saving steps"
    )
    assert links[-1] == ("step=3.ckpt", "last.ckpt") and ("step=2.ckpt", "last.ckpt") in links, broken(
        "ModelCheckpoint._link_checkpoint"
    )


def test_a_step_counted_as_saved_is_skipped_by_modelcheckpoint(tmp_path):
    uses(ModelCheckpoint, "_should_skip_saving_checkpoint", "self._last_global_step_saved == trainer.global_step")

    class CountsStepOneAsSaved(compat.LinkingModelCheckpoint):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 1:
                self.count_as_saved(trainer)
            super().on_train_batch_end(trainer, *args)

    checkpoint = CountsStepOneAsSaved(
        dirpath=tmp_path, filename="step={step}", save_top_k=-1, every_n_train_steps=1, auto_insert_metric_name=False
    )
    fit_with_checkpoint(checkpoint, max_steps=2)
    saved = sorted(p.name for p in tmp_path.iterdir())
    assert saved == ["step=2.ckpt"], broken("ModelCheckpoint._last_global_step_saved")


def test_the_strategy_base_replaces_ddps_wrapper_and_hooks():
    private_method(DDPStrategy, "_setup_model")
    private_method(DDPStrategy, "_register_ddp_hooks")
    called_in(DDPStrategy, "configure_ddp", "_setup_model")
    called_in(DDPStrategy, "configure_ddp", "_register_ddp_hooks")


def test_the_mesh_strategy_base_makes_every_process_data_parallel():
    uses(ModelParallelStrategy, "setup_environment", "self._data_parallel_size")
    strategy = compat.DataParallelMeshStrategy(tensor_parallel_size=1)
    strategy.parallel_devices, strategy.num_nodes = [torch.device("cpu")] * 2, 3
    with contextlib.suppress(Exception):  # no process group here: only the size it sets matters
        strategy.setup_environment()
    assert strategy._data_parallel_size == 6, broken("ModelParallelStrategy._data_parallel_size")


def test_the_logger_base_claims_the_listed_version(tmp_path):
    (tmp_path / "run" / "version_0").mkdir(parents=True)

    class Skipping(compat.VersionClaimingTensorBoardLogger):
        def claim_version(self, listed):
            return listed + 10

    assert Skipping(tmp_path, name="run").version == 11, broken("TensorBoardLogger._get_next_version")
    private_method(TensorBoardLogger, "_get_next_version")


def test_the_progress_bar_base_titles_the_training_bar():
    private_method(RichProgressBar, "_get_train_description")
    called_in(RichProgressBar, "on_train_epoch_start", "_get_train_description")

    class Titled(compat.TitledRichProgressBar):
        def train_description(self, current_epoch):
            return f"title {current_epoch}"

    assert Titled()._get_train_description(3) == "title 3"


def test_the_throughput_base_counts_and_replaces_per_stage():
    monitor = compat.CountingThroughputMonitor(batch_size_fn=len)
    trainer = L.Trainer(accelerator="cpu", logger=False)
    trainer.state.fn, trainer.state.stage = TrainerFn.FITTING, RunningStage.TRAINING  # as fit() sets them
    module = Recorder()
    monitor.setup(trainer, module, TrainerFn.FITTING)
    monitor.on_train_start(trainer, module)
    assert RunningStage.TRAINING in monitor.stages(), broken("ThroughputMonitor._throughputs")
    monitor.count_batch(RunningStage.TRAINING, samples=2, length=6)
    monitor.count_batch(RunningStage.TRAINING, samples=2, length=6)
    assert (
        monitor._samples[RunningStage.TRAINING],
        monitor._lengths[RunningStage.TRAINING],
        monitor._batches[RunningStage.TRAINING],
    ) == (4, 12, 2), broken("ThroughputMonitor's counts")
    replacement = object()
    monitor.set_throughput(RunningStage.TRAINING, replacement)
    assert monitor._throughputs[RunningStage.TRAINING] is replacement
    for counted in ("self._throughputs[stage]", "self._samples[stage] +=", "self._batches[stage] +="):
        uses(ThroughputMonitor, "_update", counted)


def test_the_sigterm_agreement_replaces_the_handlers_and_the_loops_broadcasts():
    private_method(_TrainingEpochLoop, "_broadcast_sigterm_tensor")
    called_in(_TrainingEpochLoop, "advance", "_broadcast_sigterm_tensor")
    private_method(_SignalConnector, "_sigterm_notifier_fn")
    uses(_SignalConnector, "register_signal_handlers", "self._sigterm_notifier_fn")
    notified, agreed = [], [False]

    class SignalsItself(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 0:
                os.kill(os.getpid(), signal.SIGTERM)

    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[SignalsItself()],
    )
    compat.replace_sigterm_agreement(trainer, lambda signum, frame: notified.append(signum), lambda: agreed[0])
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)  # this process survives a moved handler
    try:
        trainer.fit(Recorder())
    finally:
        signal.signal(signal.SIGTERM, previous)
    # One process: Lightning consults no agreement, and the notified flag is not Lightning's, so the fit ends.
    assert notified == [signal.SIGTERM], broken("_SignalConnector._sigterm_notifier_fn")
    assert trainer.global_step == 3 and not trainer.received_sigterm
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()  # what the loop calls per batch with several processes
    agreed[0] = True
    with pytest.raises(SIGTERMException):
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()
    assert trainer.received_sigterm


def test_launched_ranks_are_the_popen_launchers_processes():
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_checkpointing=False)
    launcher = trainer.strategy.launcher
    assert isinstance(launcher.procs, list), broken("_SubprocessScriptLauncher.procs")
    launcher.procs.append(sentinel := object())
    assert compat.launched_ranks(trainer) == [sentinel]
    spawned = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", logger=False, enable_checkpointing=False)
    assert compat.launched_ranks(spawned) == []


@pytest.mark.parametrize("stopped", [False, True])
def test_the_child_process_observer_is_stopped(stopped):
    """Lightning's observer SIGKILLs its "main" process once a child has ended non-zero; stopped, it does not. Here the
    main process it would kill is a stand-in, never this one."""
    import subprocess
    import sys

    from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

    failed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    failed.wait()
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        # It first looks after a second: stopped well before.
        observer = _ChildProcessObserver(main_pid=stand_in.pid, child_processes=[failed], sleep_period=1)
        observer.start()
        if stopped:
            compat.stop_child_process_observer()
        observer.join(10)
        assert not observer.is_alive()
        if stopped:
            assert stand_in.poll() is None, broken("_ChildProcessObserver._run")
        else:
            assert stand_in.wait(timeout=10) == -signal.SIGKILL
    finally:
        stand_in.kill()
        stand_in.wait()
