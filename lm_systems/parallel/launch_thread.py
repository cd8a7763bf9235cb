"""LaunchThread: a container's collectives issued from a thread of their own, off autograd's thread."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch


class LaunchThread:
    """Runs submitted launches, in submission order, on one daemon thread; ``drain()`` waits for them.

    Autograd runs a container's gradient hooks on its own thread, between backward's kernel launches. On a
    host that launches kernels no faster than the GPU runs them, every all-reduce launched there (tens of
    microseconds of Python and c10d bookkeeping) delays the rest of the backward. Handed to this thread,
    it costs the hook a queue put, and c10d releases the GIL while it launches, so the two threads
    overlap. The order of launches, which must be the same on every rank, is the order of submission. On
    CUDA each launch runs with the stream that was current where it was submitted, so it waits for the
    kernels that produced its gradients.
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, launch: Callable[[], None]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="lm_systems-launch", daemon=True)
            self._thread.start()
        stream = torch.cuda.current_stream(self._device) if self._device.type == "cuda" else None
        self._queue.put((launch, stream))

    def drain(self) -> None:
        """Wait until every submitted launch has run; re-raise the first error one raised."""
        if self._thread is not None:
            done = threading.Event()
            self._queue.put(done)
            done.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("a gradient all-reduce failed to launch on the launch thread") from error

    def close(self) -> None:
        """Drain, then stop the thread."""
        if self._thread is not None:
            self.drain()
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        while (item := self._queue.get()) is not None:
            self._run_one(item)  # its locals (a launch, holding its container) end with it

    def _run_one(self, item: threading.Event | tuple[Callable[[], None], torch.cuda.Stream | None]) -> None:
        if isinstance(item, threading.Event):  # drain()'s mark: everything before it has run
            item.set()
            return
        launch, stream = item
        if self._error is not None:
            return  # after a failure launch nothing more; drain() reports it
        try:
            if stream is None:
                launch()
            else:
                with torch.cuda.stream(stream):
                    launch()
        except BaseException as error:  # noqa: BLE001 - handed to drain() on the submitting thread
            self._error = error
