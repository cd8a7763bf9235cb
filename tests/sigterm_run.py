"""SIGTERM to a running ``python train.py --devices 2``: the command the user typed (rank 0; Lightning started
rank 1 from it), as a scheduler or ``kill`` sends it; and a rank of such a run that dies. Shared by the CPU (gloo)
and GPU (NCCL) tests; also a rank killed while a checkpoint directory is being written."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from lm_systems.files.checkpoint_dir import is_checkpoint_dir
from lm_systems.files.checkpoint_io import read_checkpoint


def sigterm_after_first_checkpoint(train_py, run_dir: Path, *args: str, signum: int = signal.SIGTERM) -> None:
    """Start the run with ``args`` (checkpointing every step, no step limit that it could reach), send it ``signum``
    (SIGTERM, or SIGINT: Ctrl-C) once step=1.ckpt is written, and assert that it exits 128 + ``signum``, that rank 1
    ends too (no rank left waiting in a collective), that last.ckpt holds a step the run reached and that the ranks
    saved crash.ckpt together, at the step they stopped at (none older than last.ckpt's), naming it to resume from."""
    with train_py.start(*args, "--max_steps", "100000", "--checkpointing_interval", "1", cwd=run_dir) as run:
        deadline = time.monotonic() + 240
        while not list(run_dir.rglob("step=1.ckpt")):
            assert run.poll() is None and time.monotonic() < deadline, "no step=1.ckpt"
            time.sleep(0.2)
        ranks = [child for child in children_of(run.pid) if local_rank(child) == "1"]
        assert len(ranks) == 1, ranks
        run.send_signal(signum)
        _, err = run.communicate(timeout=120)
        assert run.returncode == 128 + signum, err[-3000:]
        deadline = time.monotonic() + 60
        while alive(ranks[0]):
            assert time.monotonic() < deadline, f"rank 1 (pid {ranks[0]}) still running after rank 0 exited"
            time.sleep(0.2)
    (last,) = run_dir.rglob("last.ckpt")
    last_step = read_checkpoint(last)["global_step"]
    assert 1 <= last_step < 100000
    (crash,) = run_dir.rglob("crash.ckpt")
    assert read_checkpoint(crash)["global_step"] >= last_step
    named = [line for line in err.splitlines() if "resume with --ckpt_path" in line]
    assert named and (run_dir / named[-1].split("--ckpt_path ")[1]).resolve() == crash.resolve(), err[-3000:]


FAILURES = {
    "kill -9 rank 1": ("1", []),
    "kill -9 rank 0": ("0", []),
    "an error on rank 1": (None, ["--trainer.callbacks+=tests.failing_rank.FailOnRank"]),  # at step 2
}
"""How a rank dies: which one is killed (None: rank 1 raises), and the flags that make it."""


def rank_dies_after_first_checkpoint(train_py, run_dir: Path, failure: str, *args: str) -> None:
    """Start the run with ``args`` (checkpointing every step, no step limit that it could reach), make a rank die
    (``FAILURES[failure]``) once step=1.ckpt is written, and assert that the survivor stops within seconds, its
    stderr's one ``error:`` line (the last) naming the dead rank and a whole checkpoint; then that the run resumes
    from that checkpoint."""
    killed, flags = FAILURES[failure]
    with train_py.start(*args, *flags, "--max_steps", "100000", "--checkpointing_interval", "1", cwd=run_dir) as run:
        deadline = time.monotonic() + 240
        while not list(run_dir.rglob("step=1.ckpt")):
            assert run.poll() is None and time.monotonic() < deadline, "no step=1.ckpt"
            time.sleep(0.2)
        (rank_1,) = [child for child in children_of(run.pid) if local_rank(child) == "1"]
        if killed is not None:
            os.kill(run.pid if killed == "0" else rank_1, signal.SIGKILL)
        stopped_at = time.monotonic()
        _, err = run.communicate(timeout=120)  # rank 1 writes to the same stderr: this waits for both
        while alive(rank_1):
            assert time.monotonic() - stopped_at < 60, "rank 1 still running"
            time.sleep(0.2)
        took = time.monotonic() - stopped_at
    dead = killed or "1"
    lines = err.strip().splitlines()
    said = [line for line in lines if line.startswith("error:")]
    assert len(said) == 1 and said[0] == lines[-1], err[-3000:]
    how = {"kill -9 rank 1": "(killed by SIGKILL)", "an error on rank 1": "(exit status 1)"}.get(failure, "")
    assert said[0].startswith(f"error: rank {dead} ") and how in said[0], said[0]
    assert run.returncode == (-signal.SIGKILL if killed == "0" else 1)
    assert took < 20 + (30 if killed is None else 0), took  # the error's own traceback takes rank 1 a while
    survivor = "1" if dead == "0" else "0"
    assert not any(line.startswith(f"[rank{survivor}]") for line in lines), err[-3000:]  # no survivor traceback
    named = Path(said[0].rsplit("--ckpt_path ", 1)[1])
    step = read_checkpoint(run_dir / named)["global_step"]
    assert named.name == f"step={step}.ckpt" and step >= 1
    train_py.run_ok(*args, "--max_steps", str(step + 1), "--ckpt_path", str(named), cwd=run_dir)


SLOW_WRITES = "--trainer.callbacks+=tests.slow_checkpoint_writes.SlowCheckpointWrites"


def rank_1_killed_mid_save(train_py, run_dir: Path, *args: str) -> Path:
    """Start the run with ``args`` (a sharded strategy: checkpoint directories, each step's, written in the
    background and slowly) and kill -9 rank 1 while a save is being written (once step=1.ckpt is whole); assert
    that rank 0 stops within seconds, its one ``error:`` line naming rank 1 and the newest whole checkpoint, which
    last.ckpt names too: never the directory in flight. Returns the checkpoint named."""
    with train_py.start(*args, SLOW_WRITES, "--checkpointing_interval", "1", cwd=run_dir) as run:
        deadline = time.monotonic() + 240
        while not (whole_checkpoints(run_dir) and being_written(run_dir)):
            assert run.poll() is None and time.monotonic() < deadline, "no save in flight after step=1.ckpt"
            time.sleep(0.1)
        (rank_1,) = [child for child in children_of(run.pid) if local_rank(child) == "1"]
        os.kill(rank_1, signal.SIGKILL)
        in_flight = {path.name.split(".tmp-")[0] for path in being_written(run_dir)}
        stopped_at = time.monotonic()
        _, err = run.communicate(timeout=120)
        took = time.monotonic() - stopped_at
    lines = err.strip().splitlines()
    said = [line for line in lines if line.startswith("error:")]
    assert len(said) == 1 and said[0] == lines[-1], err[-3000:]
    assert said[0].startswith("error: rank 1 ") and "(killed by SIGKILL)" in said[0], said[0]
    assert run.returncode == 1 and took < 20, (run.returncode, took)
    assert not any(line.startswith("[rank0]") for line in lines), err[-3000:]  # no survivor traceback
    assert "--ckpt_path " in said[0], said[0]
    named = run_dir / said[0].rsplit("--ckpt_path ", 1)[1]
    whole = whole_checkpoints(run_dir)
    assert named.name == max(whole, key=lambda path: int(path.name[5:-5])).name and named.name not in in_flight
    (last,) = run_dir.rglob("last.ckpt")
    assert last.resolve() == named.resolve()
    assert not [path for path in run_dir.rglob("step=*.ckpt") if path not in whole], "a half-written one is named"
    return named


def whole_checkpoints(run_dir: Path) -> list[Path]:
    """The checkpoint directories under ``run_dir`` that were published whole."""
    return [path for path in run_dir.rglob("step=*.ckpt") if is_checkpoint_dir(path)]


def being_written(run_dir: Path) -> list[Path]:
    """The checkpoint directories under ``run_dir`` not yet whole (a temporary name, or no metadata yet)."""
    return [path for path in run_dir.rglob("step=*.ckpt*") if path.is_dir() and not is_checkpoint_dir(path)]


def children_of(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
            if int(fields[1]) == pid:
                children.append(int(stat.parent.name))
    return children


def local_rank(pid: int) -> str | None:
    """The LOCAL_RANK in ``pid``'s environment: Lightning launches rank 1 with it; other children (the inductor's
    compile workers on a many-core host) have none."""
    with contextlib.suppress(OSError):
        for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            if entry.startswith(b"LOCAL_RANK="):
                return entry.split(b"=", 1)[1].decode()
    return None


def alive(pid: int) -> bool:
    """Whether ``pid`` is running (a zombie, exited but not yet reaped, is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
