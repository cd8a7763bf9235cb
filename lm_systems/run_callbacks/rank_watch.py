"""A rank that dies ends the run in one line: which rank, how it ended, and the checkpoint to resume from.

When one process of a distributed run ends (kill -9, an out-of-memory kill, an exception of its own), the others
find out inside a collective: gloo raises "Connection reset by peer" mid-step, and the traceback of that, with the
teardown it interrupted, named neither the rank nor a checkpoint. Lightning's popen launcher also starts a thread in
rank 0 that SIGKILLs the whole run, rank 0 included, 5 s after a child rank ends non-zero, without a word.

Here the ranks watch one another instead (``RankWatch``): rank 0 the ranks it started, which it polls; they rank 0,
their parent, whose end hands them to another. The moment one ends with a status other than a finished or an
orderly stop (SIGTERM, Ctrl-C), its watcher names it and the last whole checkpoint on stderr, stops the other ranks
and exits with status 1, at once: a survivor need not be inside a collective (NCCL's may wait out their timeout)
to notice. A rank that loses a peer inside a collective leaves the report to those watches and reports itself
only when none came within ``REPORT_WAIT_S`` (ranks started by another launcher: torchrun, SLURM).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from typing import NoReturn, Optional

import lightning.pytorch as L
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from lm_systems.compat.lightning import launched_ranks, stop_child_process_observer
from lm_systems.run_callbacks.summary import shown_path

POLL_S = 0.5
"""How often rank 0 looks at the ranks it started."""
REPORT_WAIT_S = 15.0
"""How long a rank that lost a peer waits for rank 0's report (and the stop that comes with it) before its own."""
_ENDING = threading.Lock()
"""Held by the one thread that reports the run's end."""
ORDERLY_ENDS = {0, 128 + signal.SIGTERM, 128 + signal.SIGINT, -signal.SIGTERM, -signal.SIGINT}
"""Exit statuses of a rank that finished or stopped with the others (SIGTERM, Ctrl-C): not a failure."""
_LOST_PEER = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Timed out waiting",
    "NCCL communicator was aborted",
)
"""What gloo's and NCCL's errors say when the process at the other end is gone or stopped answering."""


def lost_a_peer(error: BaseException) -> bool:
    """Whether ``error`` (or one it chains) is a collective that failed because another rank is gone."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, dist.DistError) or (
            isinstance(error, RuntimeError) and any(marker in str(error) for marker in _LOST_PEER)
        ):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def how_it_ended(returncode: int) -> str:
    """``"killed by SIGKILL"``, ``"exit status 1"``."""
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit status {returncode}"


class RankWatch(L.Callback):
    """Ends a distributed fit in one line when one of its ranks dies (see the module doc); nothing in one process."""

    def __init__(self) -> None:
        # Made in ``setup``: a spawn launcher pickles the trainer's callbacks, and an Event does not pickle.
        self._stop: Optional[threading.Event] = None
        self._watch: Optional[threading.Thread] = None

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit" or trainer.world_size == 1:
            return
        ranks = launched_ranks(trainer)
        if ranks:  # this process launched them
            stop_child_process_observer()
            watch, watched = self._watch_ranks, (trainer, ranks)
        elif was_launched_by_its_local_rank_0(trainer):
            watch, watched = self._watch_launcher, (trainer, os.getppid())
        else:
            return
        self._stop = threading.Event()
        self._watch = threading.Thread(target=watch, args=(*watched, self._stop), name="rank-watch", daemon=True)
        self._watch.start()

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if trainer.world_size == 1:
            return
        if not lost_a_peer(exception):
            self._stop_watching()  # this rank's own stop (an error, SIGTERM, Ctrl-C): the others' ends follow from it
            return
        if self._watch is not None:  # it reports the rank that ended, or rank 0's watch stops this process
            self._watch.join(REPORT_WAIT_S)
        end_the_run(
            f"rank {trainer.global_rank} lost its connection to another rank at step {trainer.global_step} (that rank "
            f"ended or stopped answering; its own output says why); {resume_advice(trainer)}",
            trainer,
        )

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # The ranks end on their own from here: one that exits before another's teardown is not a failure.
        self._stop_watching()

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._stop_watching()

    def _stop_watching(self) -> None:
        if self._stop is not None:
            self._stop.set()

    @staticmethod
    def _watch_ranks(trainer: L.Trainer, ranks: list[subprocess.Popen], stop: threading.Event) -> None:
        while not stop.wait(POLL_S):
            for local_rank, process in enumerate(ranks, start=1):
                returncode = process.poll()
                if returncode is None or returncode in ORDERLY_ENDS or stop.is_set():
                    continue
                for other in ranks:
                    if other.poll() is None:
                        other.kill()
                rank = trainer.global_rank + local_rank
                end_the_run(
                    f"rank {rank} (pid {process.pid}) ended ({how_it_ended(returncode)}) at step "
                    f"{trainer.global_step}, so every rank stopped; {resume_advice(trainer)}",
                    trainer,
                )

    @staticmethod
    def _watch_launcher(trainer: L.Trainer, launcher_pid: int, stop: threading.Event) -> None:
        while not stop.wait(POLL_S):
            if os.getppid() != launcher_pid and not stop.is_set():  # its children go to another parent when it ends
                rank = trainer.global_rank - trainer.local_rank
                end_the_run(f"rank {rank} ended at step {trainer.global_step}; {resume_advice(trainer)}", trainer)


def was_launched_by_its_local_rank_0(trainer: L.Trainer) -> bool:
    """Whether this process was started by its node's local rank 0, as Lightning's popen launcher starts the others
    (its environment then is Lightning's own; torchrun's and SLURM's have their own classes)."""
    return isinstance(trainer.strategy.cluster_environment, LightningEnvironment) and trainer.local_rank > 0


def end_the_run(message: str, trainer: L.Trainer) -> NoReturn:
    """Print ``error: message``, write out what the loggers hold, and end this process at once with status 1: its main
    thread may wait in a collective that never ends, and a normal exit would wait on the process group's teardown. A
    second caller (the other thread) waits until the process is gone."""
    _ENDING.acquire()
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    for logger in trainer.loggers:
        with contextlib.suppress(Exception):  # the run is over and said why: a logger that cannot save changes nothing
            logger.save()
    os._exit(1)


def resume_advice(trainer: L.Trainer) -> str:
    """Where to resume: this run's newest whole checkpoint, else the one it resumed from."""
    callback = trainer.checkpoint_callback
    last = callback.last_model_path if isinstance(callback, ModelCheckpoint) else ""
    resumable = os.path.realpath(last) if last and os.path.exists(last) else trainer.ckpt_path
    if not resumable:
        return "no checkpoint was written before: train again (--checkpointing_interval N saves every N steps)"
    return f"resume from the last whole checkpoint with --ckpt_path {shown_path(str(resumable))}"
