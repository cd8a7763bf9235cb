"""SIGTERM to a running ``python train.py --devices 2``: the command the user typed (rank 0; Lightning started
rank 1 from it), as a scheduler or ``kill`` sends it. Shared by the CPU (gloo) and GPU (NCCL) tests."""

from __future__ import annotations

import contextlib
import signal
import time
from pathlib import Path

from lm_systems.files.checkpoint_io import read_checkpoint


def sigterm_after_first_checkpoint(train_py, run_dir: Path, *args: str) -> None:
    """Start the run with ``args`` (checkpointing every step, no step limit that it could reach), send it SIGTERM once
    step=1.ckpt is written, and assert that it exits 143, that rank 1 ends too (no rank left waiting in a
    collective) and that last.ckpt holds a step the run reached."""
    with train_py.start(*args, "--max_steps", "100000", "--checkpointing_interval", "1", cwd=run_dir) as run:
        deadline = time.monotonic() + 240
        while not list(run_dir.rglob("step=1.ckpt")):
            assert run.poll() is None and time.monotonic() < deadline, "no step=1.ckpt"
            time.sleep(0.2)
        ranks = [child for child in children_of(run.pid) if local_rank(child) == "1"]
        assert len(ranks) == 1, ranks
        run.send_signal(signal.SIGTERM)
        _, err = run.communicate(timeout=120)
        assert run.returncode == 128 + signal.SIGTERM, err[-3000:]
        deadline = time.monotonic() + 60
        while alive(ranks[0]):
            assert time.monotonic() < deadline, f"rank 1 (pid {ranks[0]}) still running after rank 0 exited"
            time.sleep(0.2)
    (last,) = run_dir.rglob("last.ckpt")
    assert 1 <= read_checkpoint(last)["global_step"] < 100000


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
