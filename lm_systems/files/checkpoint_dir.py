"""Checkpoint directories: one checkpoint written by every rank at once through torch.distributed.checkpoint (DCP),
each rank writing only the shards it holds, and read back at any world size, under any strategy.

A directory ``step=N.ckpt/`` holds the checkpoint's tensors in DCP's files (``__<rank>_<n>.distcp``, ``.metadata``)
under flat keys (``model/<parameter name>``, ``optimizer/<o>/<parameter index>/<state key>``), each with its full
shape whatever the layout that wrote it, and everything else Lightning keeps (loops, callbacks, step, schedule,
hyperparameters, the optimizers' parameter groups, the data position) in ``meta.pt``, written by rank 0. A sharded
tensor is handed to DCP as a DTensor over the rows this rank holds; a replicated one as a plain tensor, which DCP
has one rank write. Reading builds the same keys in the reader's own layout, so DCP reads each rank's rows of each
tensor, whichever ranks wrote them.

Whole or nothing: a directory is written under a temporary name beside its own (``<name>.tmp-<pid>-<tag>``, rank 0's
process id) and renamed only once every rank's part and the metadata are on disk. An asynchronous save returns once
the tensors are copied to host memory; the write goes on in a thread, and the rename, and whatever was waiting on
it (the ``last.ckpt`` link), happen only when it is whole. Plain torch.distributed: no Lightning here.
"""

from __future__ import annotations

import os
import shutil
import threading
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lm_systems.errors import RunError
from lm_systems.files.disk_space import free_bytes, no_room_message, no_space_message, tensor_bytes
from lm_systems.files.host_staging import HostStager

META = "meta.pt"
"""The checkpoint without its tensors, written by rank 0."""
MODEL, OPTIMIZER = "model", "optimizer"
WRITE_THREADS = 4
"""Files each rank writes at once: DCP splits a rank's tensors over them."""
WRITING, WHOLE, FAILED = "writing", "whole", "failed"  # the states of a save in flight


def is_checkpoint_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a whole checkpoint directory (one that was published: its metadata and meta.pt exist)."""
    path = Path(path)
    return (path / ".metadata").is_file() and (path / META).is_file()


def model_key(name: str) -> str:
    return f"{MODEL}/{name}"


def optimizer_key(optimizer: int, index: int, key: str) -> str:
    return f"{OPTIMIZER}/{optimizer}/{index}/{key}"


def split_checkpoint(checkpoint: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The checkpoint's tensors under flat keys (weights and optimizer state), and the rest (``meta.pt``'s part).

    Per-parameter optimizer state must be tensors (AdamW's, Adam's, SGD's are): a Python value would be saved by
    rank 0 only, and lost for the parameters other ranks hold.
    """
    rest = dict(checkpoint)
    tensors = {model_key(name): value for name, value in rest.pop("state_dict", {}).items()}
    optimizers = []
    for number, state in enumerate(rest.pop("optimizer_states", [])):
        for index, values in state.get("state", {}).items():
            for key, value in values.items():
                if not isinstance(value, torch.Tensor):
                    raise TypeError(
                        f"optimizer state {key!r} of parameter {index} is a {type(value).__name__}, not a tensor: a "
                        "checkpoint directory holds tensor state only; set --trainer.strategy.checkpoint_format file"
                    )
                tensors[optimizer_key(number, int(index), key)] = value
        optimizers.append({"param_groups": state.get("param_groups", [])})
    rest["optimizer_states"] = optimizers
    return tensors, rest


def stored_tensors(path: str | os.PathLike) -> dict[str, TensorStorageMetadata]:
    """Every tensor the directory holds, by key: its full shape and dtype."""
    stored = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {key: value for key, value in stored.items() if isinstance(value, TensorStorageMetadata)}


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """``meta.pt``: the checkpoint without its tensors."""
    return torch.load(Path(path) / META, map_location="cpu", weights_only=False)


def read_into(path: str | os.PathLike, targets: dict[str, torch.Tensor], group: Optional[dist.ProcessGroup]) -> None:
    """Fill ``targets`` (flat keys; DTensors take this rank's rows) from the directory: a collective over ``group``."""
    dcp.load(targets, storage_reader=FileSystemReader(str(path)), process_group=group)


def read_whole(path: str | os.PathLike, optimizer: bool = True) -> dict[str, Any]:
    """The checkpoint as one process holds a one-file checkpoint: full tensors on the CPU, optimizer state by
    parameter index (without ``optimizer``: the weights only). Not a collective."""
    wanted = {
        key: torch.empty(value.size, dtype=value.properties.dtype)
        for key, value in stored_tensors(path).items()
        if optimizer or key.startswith(MODEL + "/")
    }
    dcp.load(wanted, storage_reader=FileSystemReader(str(path)), no_dist=True)
    checkpoint = read_meta(path)
    checkpoint["state_dict"] = {key.split("/", 1)[1]: value for key, value in wanted.items() if key.startswith(MODEL)}
    saved_optimizers = checkpoint.pop("optimizer_states", [])
    if optimizer:
        states: list[dict[int, dict[str, torch.Tensor]]] = [{} for _ in saved_optimizers]
        for key, value in wanted.items():
            if key.startswith(OPTIMIZER + "/"):
                _, number, index, name = key.split("/", 3)
                states[int(number)].setdefault(int(index), {})[name] = value
        checkpoint["optimizer_states"] = [
            {"state": dict(sorted(state.items())), "param_groups": saved["param_groups"]}
            for state, saved in zip(states, saved_optimizers, strict=True)
        ]
    return checkpoint


class CheckpointDirWriter:
    """Writes checkpoint directories from every rank (every rank calls ``save`` with its own part), at most one in
    flight; ``asynchronous``: ``save`` returns once the tensors are copied to host memory.

    ``group`` is a gloo group of every rank for the save's own coordination, so that a write in the background never
    interleaves with training's collectives. ``when_published(path, action)`` runs ``action`` (on rank 0) once
    ``path`` is whole under its own name: at once if it is not being written, never if its write failed. An error
    of a background write is raised by the next ``save`` or ``wait``.
    """

    def __init__(self, group: dist.ProcessGroup, asynchronous: bool = True) -> None:
        self.group = group
        self.asynchronous = asynchronous
        self.rank = dist.get_rank(group)
        self._lock = threading.Lock()
        self._pending: Optional[_PendingSave] = None
        # The copy to host memory the loop waits for: into pinned buffers on a CUDA machine (so the copy runs at the
        # link's speed), plain memory elsewhere, kept for the next save (allocate_host_buffers makes them before the
        # first).
        self._stager = HostStager(group, pinned=torch.cuda.is_available()) if asynchronous else None

    def save(self, checkpoint: dict[str, Any], path: str | os.PathLike) -> None:
        self.wait()  # one save in flight: its host buffers are the next one's
        tensors, rest = split_checkpoint(checkpoint)
        path = Path(path).absolute()  # the write goes on in another thread: not relative to a working folder
        self._check_space(path, tensor_bytes(tensors))
        temporary = self._temporary_name(path)
        temporary.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            torch.save(rest, temporary / META)
        writer = FileSystemWriter(str(temporary), thread_count=WRITE_THREADS)
        pending = _PendingSave(path, temporary)
        try:
            if not self.asynchronous:
                dcp.save(tensors, storage_writer=writer, process_group=self.group)
                self._publish(pending)
                return
            future = dcp.async_save(tensors, storage_writer=writer, process_group=self.group, async_stager=self._stager)
        except BaseException:
            shutil.rmtree(temporary, ignore_errors=True)  # nothing in flight: a later save or wait must not wait
            raise
        self._pending = pending
        future.add_done_callback(lambda done: self._finish(pending, done))

    def allocate_host_buffers(self, checkpoint: dict[str, Any]) -> None:
        """Copy ``checkpoint``'s tensors to host memory once, ahead of the first save: the staging buffers, kept from
        one save to the next (by tensor storage), then exist before a save needs them, and each save only copies
        into them. Not a collective; nothing is written."""
        if self._stager is not None:
            self._stager.stage(split_checkpoint(checkpoint)[0])

    def when_published(self, path: str | os.PathLike, action: Callable[[], None]) -> None:
        self._when_whole(action, Path(path).absolute())

    def after_pending(self, action: Callable[[], None]) -> None:
        """Run ``action`` (on the writing thread) once the save in flight is published, at once if none is in
        flight, never if it fails: removing an older checkpoint waits for the newer one to be whole."""
        self._when_whole(action, None)

    def _when_whole(self, action: Callable[[], None], path: Optional[Path]) -> None:
        """``action`` once the save in flight (the one to ``path``, any without) is published: queued while it is
        written, dropped if it failed, at once if there is none."""
        with self._lock:
            pending = self._pending
            if pending is not None and pending.state != WHOLE and path in (None, pending.path):
                if pending.state == WRITING:
                    pending.actions.append(action)
                return
        action()

    def wait(self) -> None:
        """Wait for the save in flight to be written and published; raise its error, if it failed."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        pending.done.wait()
        if pending.error is not None:
            raise RuntimeError(f"writing checkpoint {str(pending.path)!r} failed: {pending.error}") from pending.error

    def _finish(self, pending: _PendingSave, future: Future) -> None:
        """On the writing thread, once this rank's part and (on rank 0) the metadata are written."""
        try:
            future.result()
            self._publish(pending)
        except BaseException as error:  # raised in the main thread by wait()
            with self._lock:
                pending.state, pending.actions, pending.error = FAILED, [], error
        finally:
            pending.done.set()

    def _publish(self, pending: _PendingSave) -> None:
        """Rank 0, once DCP has gathered every rank's write (its metadata is written after them): rename, then act.
        An action asked for from now on runs at once (the state changes with the list taken, under the lock)."""
        if self.rank == 0:
            _rename_directory(pending.temporary, pending.path)
        with self._lock:
            actions, pending.actions, pending.state = pending.actions, [], WHOLE
        for action in actions:
            action()

    def _nothing_in_flight(self) -> None:
        """Before a collective of the main thread on the writer's group: the writing thread's collectives of a save in
        flight could meet it in another order on another rank, a hang; an error names the bug instead."""
        if self._pending is not None:
            raise RuntimeError(f"a collective on the checkpoint writer's group while {self._pending.path} is written")

    def _temporary_name(self, path: Path) -> Path:
        self._nothing_in_flight()
        name = [f"{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"]
        dist.broadcast_object_list(name, src=dist.get_global_rank(self.group, 0), group=self.group)
        return path.with_name(name[0])

    def check_room(self, folder: str | os.PathLike, checkpoint: dict[str, Any]) -> None:
        """A collective: a RunError on every rank if ``folder``'s disk cannot hold one checkpoint of ``checkpoint``'s
        tensors, so that a run does not train only to fail at its first save. A save in flight is waited for first:
        its writing thread runs collectives on the same group, and two threads' collectives on one group may meet
        in different orders on different ranks (a hang)."""
        self.wait()
        needed, free, short = self._room(Path(folder), tensor_bytes(split_checkpoint(checkpoint)[0]))
        if short:
            raise RunError(no_room_message(folder, needed, free))

    def _check_space(self, path: Path, mine: int) -> None:
        """Every rank's bytes summed; refused on every rank, before anything is written, if the disk lacks them."""
        needed, free, short = self._room(path.parent, mine)
        if short:
            raise RunError(no_space_message(path, needed, free))

    def _room(self, folder: Path, mine: int) -> tuple[int, int, bool]:
        """Every rank's bytes summed, this rank's free bytes in ``folder``, and whether any rank lacks room."""
        self._nothing_in_flight()
        needed = torch.tensor([mine], dtype=torch.int64)
        dist.all_reduce(needed, group=self.group)
        free = free_bytes(folder)
        short = torch.tensor([int(needed.item() > free)], dtype=torch.int64)
        dist.all_reduce(short, op=dist.ReduceOp.MAX, group=self.group)
        return int(needed.item()), free, bool(short.item())

    def close(self) -> None:
        """Wait for the save in flight (teardown: the process group is still whole); free the staging buffers."""
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None


class _PendingSave:
    def __init__(self, path: Path, temporary: Path) -> None:
        self.path, self.temporary = path, temporary
        self.state = WRITING  # changed under the writer's lock, with the actions taken or dropped
        self.actions: list[Callable[[], None]] = []
        self.done = threading.Event()
        self.error: Optional[BaseException] = None


def _rename_directory(temporary: Path, path: Path) -> None:
    """``temporary`` renamed to ``path``; a directory already there (a resumed run saving the same step again) is
    moved aside first and removed after, so ``path`` names one whole checkpoint or, for that instant, none."""
    _sync_directory(temporary)
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        old = path.with_name(f"{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.replace(path, old)
        os.replace(temporary, path)
        shutil.rmtree(old)
        _sync_directory(path.parent)
        return
    os.replace(temporary, path)
    _sync_directory(path.parent)


def _sync_directory(folder: Path) -> None:
    """Flush a directory's entries (new files, a rename) to disk."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
