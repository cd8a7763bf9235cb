"""A rank that dies ends the run in one line: which rank, how it ended, and the checkpoint to resume from.

When one process of a distributed run ends (kill -9, an out-of-memory kill, an exception of its own), the others
find out inside a collective: gloo raises "Connection reset by peer" mid-step, and the traceback of that, with the
teardown it interrupted, named neither the rank nor a checkpoint. Lightning's popen launcher also starts a thread in
rank 0 that SIGKILLs the whole run, rank 0 included, 5 s after a child rank ends non-zero, without a word.

Here rank 0 watches the ranks it started instead (``RankWatch``): the moment one ends with a status other than a
finished or an orderly stop (SIGTERM, Ctrl-C), rank 0 names it and the last whole checkpoint on stderr, stops the
other ranks and exits with status 1. A rank that loses a peer inside a collective leaves the report to rank 0 (which
stops it) and reports itself only when rank 0 is the one that ended, or when no report came within
``REPORT_WAIT_S`` (ranks started by another launcher: torchrun, SLURM).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Optional

import lightning.pytorch as L
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from lm_systems.compat.lightning import launched_ranks, stop_child_process_observer
from lm_systems.errors import RunError
from lm_systems.run.summary import shown_path

POLL_S = 0.5
"""How often rank 0 looks at the ranks it started."""
REPORT_WAIT_S = 15.0
"""How long a rank that lost a peer waits for rank 0's report (and the stop that comes with it) before its own."""
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
        self._parent_pid = os.getppid()
        # Made in ``setup``: a spawn launcher pickles the trainer's callbacks, and an Event does not pickle.
        self._stop: Optional[threading.Event] = None
        self._watch: Optional[threading.Thread] = None

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._parent_pid = os.getppid()
        ranks = launched_ranks(trainer)
        if stage != "fit" or not ranks:
            return
        stop_child_process_observer()
        self._stop = threading.Event()
        watched = (trainer, ranks, self._stop)
        self._watch = threading.Thread(target=self._watch_ranks, args=watched, name="rank-watch", daemon=True)
        self._watch.start()

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if trainer.world_size == 1:
            return
        if not lost_a_peer(exception):
            self._stop_watching()  # this rank's own stop (an error, SIGTERM, Ctrl-C): the others' ends follow from it
            return
        if self._watch is not None:  # rank 0: its watch reports the rank that ended and exits the process
            self._watch.join(REPORT_WAIT_S)
            raise RunError(
                f"lost a rank at step {trainer.global_step}, none of those this one started ended; "
                f"{resume_advice(trainer)}"
            ) from exception
        # Rank 0 (this rank's launcher) may have ended: the kernel closes a killed process's sockets before it hands
        # its children to another parent. Otherwise rank 0 reports and stops this process.
        deadline = time.monotonic() + REPORT_WAIT_S
        while time.monotonic() < deadline:
            if os.getppid() != self._parent_pid:
                raise RunError(f"rank 0 ended at step {trainer.global_step}; {resume_advice(trainer)}") from exception
            time.sleep(POLL_S / 5)
        raise RunError(
            f"rank {trainer.global_rank} lost its connection to another rank at step {trainer.global_step} (that rank "
            f"ended or stopped answering; its own output says why); {resume_advice(trainer)}"
        ) from exception

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
                global_rank = trainer.node_rank * trainer.num_devices + local_rank
                for other in ranks:
                    if other.poll() is None:
                        other.kill()
                print(
                    f"error: rank {global_rank} (pid {process.pid}) ended ({how_it_ended(returncode)}) at step "
                    f"{trainer.global_step}, so every rank stopped; {resume_advice(trainer)}",
                    file=sys.stderr,
                    flush=True,
                )
                sys.stdout.flush()
                os._exit(1)  # the main thread may be waiting in a collective that will never end


def resume_advice(trainer: L.Trainer) -> str:
    """Where to resume: this run's newest whole checkpoint, else the one it resumed from."""
    callback = trainer.checkpoint_callback
    last = callback.last_model_path if isinstance(callback, ModelCheckpoint) else ""
    resumable = os.path.realpath(last) if last and os.path.exists(last) else trainer.ckpt_path
    if not resumable:
        return "no checkpoint was written before: train again (--checkpointing_interval N saves every N steps)"
    return f"resume from the last whole checkpoint with --ckpt_path {shown_path(str(resumable))}"
