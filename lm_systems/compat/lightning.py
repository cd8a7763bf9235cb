"""Lightning's private names, each behind one public function or base class (tests: tests/compat/test_lightning.py).

Every entry says what it reaches and why no public name does it.
"""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.fabric.utilities.optimizer import _optimizer_to_device
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar, ThroughputMonitor
from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.nn import Module
from typing_extensions import override

# -- functions ---------------------------------------------------------------------------------------------------


def logs_this_step(trainer: Trainer) -> bool:
    """Whether Lightning logs the optimizer step now running (every ``log_every_n_steps``, and the last): its logger
    connector's answer, the one ``self.log`` follows; the Trainer has no public property for it."""
    return trainer._logger_connector.should_update_logs


def align_logging_step(trainer: Trainer) -> None:
    """Put the step Lightning's loggers draw at (the epoch loop's ``_batches_that_stepped``; no public setter) back on
    the optimizer steps taken, at the start of a batch, where the two are equal under automatic optimization.

    Resuming a checkpoint written at the end of a fit that validated at its last step, Lightning skips that
    validation again with a pass of its loop that trains no batch yet counts one (``advance``'s ``restarted_on_last``
    branch), and every later point of the run sat one step right of where an uninterrupted run puts it
    (tests/test_resumed_tensorboard.py).
    """
    trainer.fit_loop.epoch_loop._batches_that_stepped = trainer.global_step


def accumulates_this_batch(trainer: Trainer) -> bool:
    """Whether the training batch now ending only accumulates gradients (no optimizer step follows it): the fit
    loop's own test, which the Trainer does not expose."""
    return trainer.fit_loop._should_accumulate()


def compute_dtype(trainer: Trainer) -> torch.dtype:
    """The dtype the trainer's precision plugin computes in (bf16 under ``bf16-mixed``), as ThroughputMonitor reads
    it."""
    return _plugin_to_compute_dtype(trainer.precision_plugin)


def is_local_path(path: Union[str, Path]) -> bool:
    """Whether ``path`` is on the local filesystem (not ``s3://`` and the like), as Lightning's checkpoint IO and
    loggers decide it."""
    return _is_local_file_protocol(path)


def attached_trainer(module: LightningModule) -> Optional[Trainer]:
    """The Trainer ``module`` is attached to, or None (its public ``trainer`` property raises when there is none)."""
    return module._trainer


def optimizer_to_device(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Move ``optimizer``'s state tensors to ``device``, as Lightning does after loading a checkpoint's state."""
    _optimizer_to_device(optimizer, device)


def replace_sigterm_agreement(trainer: Trainer, notify: Callable[[int, Any], None], agree: Callable[[], bool]) -> None:
    """Make ``notify`` and ``agree`` how the ranks of a run of more than one process stop for SIGTERM.

    Lightning's SIGTERM handler (private ``_SignalConnector._sigterm_notifier_fn``) forwards the signal to the
    processes its launcher started, broadcasts rank 0's flag on the default group and sets ``received_sigterm``,
    on which the loops stop that rank at the end of its batch; the training epoch loop broadcasts rank 0's flag at
    every batch and reads it on the host (private ``_broadcast_sigterm_tensor``). Here the handler only calls
    ``notify(signum, frame)``, and before every training batch ``agree()`` says whether every rank stops now: if so,
    ``received_sigterm`` is set and ``SIGTERMException`` raised, on every rank at once. Call it before ``fit``
    registers its signal handlers (``Strategy.setup`` is). No public hook reaches either.
    """
    connector = trainer._signal_connector

    def check() -> None:
        if agree():
            connector.received_sigterm = True
            raise SIGTERMException()

    connector._sigterm_notifier_fn = notify
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = check


def launched_ranks(trainer: Trainer) -> list[subprocess.Popen]:
    """The processes this one started for local ranks 1, 2, ... (in that order) through Lightning's popen launcher
    (private ``_SubprocessScriptLauncher``, whose ``procs`` they are); empty on those ranks and for other launchers.
    No public name lists them."""
    launcher = trainer.strategy.launcher
    return list(launcher.procs) if isinstance(launcher, _SubprocessScriptLauncher) else []


def stop_child_process_observer() -> None:
    """Turn off the thread (private ``_ChildProcessObserver``) that Lightning's popen launcher starts in rank 0: on a
    child rank's non-zero exit it SIGKILLs every process of the run, rank 0 included, without a word; a watch of the
    caller's own does that job instead (``lm_systems.run_callbacks.rank_watch``). Its loop ends at its next wake-up."""
    for thread in threading.enumerate():
        if isinstance(thread, _ChildProcessObserver):
            thread._run = lambda: True


# -- base classes for Lightning classes whose behaviour lives in private methods -----------------------------------


class CommandLineOverCheckpointCLI(LightningCLI):
    """LightningCLI that does not parse a ``--ckpt_path``'s saved hyperparameters over the command line.

    Its private ``_parse_ckpt_path`` (run between ``parse_arguments`` and ``before_instantiate_classes``) replaces
    every ``--model.*`` typed with the checkpoint's value; a subclass that merges them itself leaves it out here.
    """

    @override
    def _parse_ckpt_path(self) -> None:
        pass


class LinkingModelCheckpoint(ModelCheckpoint):
    """ModelCheckpoint with three of its private steps under public names: ``save_step`` saves the current step as a
    step that meets ``every_n_train_steps`` would be saved, ``count_as_saved`` marks the current step as saved, and
    ``link_checkpoint`` (which a subclass may override) points ``last.ckpt`` at the newest file under
    ``save_last="link"``."""

    def count_as_saved(self, trainer: Trainer) -> None:
        """The current step counts as saved: ``every_n_train_steps`` and ``save_step`` skip it. (ModelCheckpoint's
        state does not carry its last saved step, so without this a resumed run saves the step it resumed from
        again at the end of its first micro-batch when it accumulates gradients.)"""
        self._last_global_step_saved = trainer.global_step

    def save_step(self, trainer: Trainer) -> None:
        """Save the current step (and ``last.ckpt``), unless it was just saved or the trainer is not saving."""
        if not self._should_skip_saving_checkpoint(trainer):
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)

    def link_checkpoint(self, trainer: Trainer, filepath: str, linkpath: str) -> None:
        ModelCheckpoint._link_checkpoint(trainer, filepath, linkpath)

    @override
    def _link_checkpoint(self, trainer: Trainer, filepath: str, linkpath: str) -> None:  # type: ignore[override]
        self.link_checkpoint(trainer, filepath, linkpath)


class ModelWrappingDDPStrategy(DDPStrategy):
    """DDPStrategy whose model wrapper is ``wrap_model(module)``'s, not torch's DistributedDataParallel.

    ``DDPStrategy._setup_model`` builds the wrapper; its ``_register_ddp_hooks`` asserts a torch DDP model on CUDA
    (and registers torch DDP's communication hooks): a wrapper that registers its own hooks skips it.
    """

    def wrap_model(self, model: Module) -> Module:
        raise NotImplementedError

    @override
    def _setup_model(self, model: Module) -> Module:
        return self.wrap_model(model)

    @override
    def _register_ddp_hooks(self) -> None:
        pass


class DataParallelMeshStrategy(ModelParallelStrategy):
    """ModelParallelStrategy whose device mesh is data parallel over every process (its ``data_parallel_size="auto"``
    spans the nodes only, and the processes are known only once the environment is set up)."""

    @override
    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_processes * self.num_nodes
        super().setup_environment()


class VersionClaimingTensorBoardLogger(TensorBoardLogger):
    """TensorBoardLogger whose version, when not given, is ``claim_version(listed)``: Lightning's private
    ``_get_next_version`` lists the folder and returns one past the highest; a subclass may claim another."""

    def claim_version(self, listed: int) -> int:
        return listed

    @override
    def _get_next_version(self) -> int:
        return self.claim_version(super()._get_next_version())


class TitledRichProgressBar(RichProgressBar):
    """RichProgressBar whose training title is ``train_description(epoch)`` (Lightning's private
    ``_get_train_description``, which a subclass may override and call through ``super()``)."""

    def train_description(self, current_epoch: int) -> str:
        return super()._get_train_description(current_epoch)

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        return self.train_description(current_epoch)


class CountingThroughputMonitor(ThroughputMonitor):
    """ThroughputMonitor with its per-stage bookkeeping under public names: ``stages()`` and ``set_throughput`` replace
    a stage's Throughput, ``count_batch`` adds a batch to a stage's counts without reading the clock."""

    def stages(self) -> list[RunningStage]:
        return list(self._throughputs)

    def set_throughput(self, stage: RunningStage, throughput: Throughput) -> None:
        self._throughputs[stage] = throughput

    def count_batch(self, stage: RunningStage, samples: int, length: int) -> None:
        self._lengths[stage] += length
        self._samples[stage] += samples
        self._batches[stage] += 1
