"""Ranks agree to stop for SIGTERM over the host, not the device.

Lightning's training loop, at every batch of a run of more than one process, broadcasts rank 0's "received
SIGTERM" flag in a device tensor on the default (NCCL) group and reads it with ``.item()``: the host waits for
every kernel queued so far, so each batch's launches start only once the GPU has drained the last one's. Here the
flags are combined over a gloo group of CPU tensors, which never waits on the device, and every rank stops at the
same batch: the first after any of them received SIGTERM (Lightning's handler also broadcasts on the default group,
and stops the signalled rank at once; both are left out, see ``lm_systems.compat.lightning.replace_sigterm_agreement``).
A SIGTERM that arrives during validation takes effect at the next training batch. A first Ctrl-C is agreed on the
same way (the ranks then raise KeyboardInterrupt together), so that a run of several processes saves ``crash.ckpt``
for either; a second Ctrl-C interrupts at once.
"""

from __future__ import annotations

import signal
import threading
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch import Trainer

from lm_systems.compat.lightning import replace_sigterm_agreement


class HostSigtermAgreement:
    """``notify`` is the SIGTERM handler and ``interrupt`` the Ctrl-C one; ``agree``, called by every rank before every
    training batch, says whether any rank has received SIGTERM (a MAX all-reduce of the signals over a gloo group of
    every rank), and raises KeyboardInterrupt on every rank where a Ctrl-C was the only one: the ranks stop together
    for either, so the crash checkpoint's collectives meet. A second Ctrl-C interrupts at once."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group = group
        self._received = 0  # the signal received here: 0, SIGINT or SIGTERM (the larger wins)
        self.agreed = False
        """Whether ``agree`` has said stop: every rank is then at the same batch boundary."""
        self._flag = torch.zeros(1, dtype=torch.int32)
        self._previous_sigint: Any = None

    @classmethod
    def install(cls, trainer: Trainer, timeout: Optional[timedelta]) -> HostSigtermAgreement:
        """Make the agreement ``trainer``'s, on a new gloo group (a collective: every rank calls it, from
        ``Strategy.setup``, before ``fit`` registers its signal handlers); Ctrl-C's handler too (main thread only)."""
        agreement = cls(dist.new_group(backend="gloo", timeout=timeout))
        replace_sigterm_agreement(trainer, agreement.notify, agreement.agree)
        if threading.current_thread() is threading.main_thread():
            agreement._previous_sigint = signal.signal(signal.SIGINT, agreement.interrupt)
        return agreement

    def notify(self, signum: int, frame: Any) -> None:
        self._received = max(self._received, signal.SIGTERM)

    def interrupt(self, signum: int, frame: Any) -> None:
        if self._received:  # a second signal: Ctrl-C's own handler, at once
            previous = self._previous_sigint if callable(self._previous_sigint) else signal.default_int_handler
            signal.signal(signal.SIGINT, previous)
            previous(signum, frame)
            return
        self._received = signal.SIGINT

    def agree(self) -> bool:
        self._flag.fill_(int(self._received))
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group)
        agreed = int(self._flag.item())
        self.agreed = agreed != 0
        if agreed == signal.SIGINT:
            raise KeyboardInterrupt
        return self.agreed

    def close(self) -> None:
        """Destroy the gloo group and let it go (from ``Strategy.teardown``): the trainer keeps ``agree`` and
        ``notify``, and with them this object, past the run. Ctrl-C's handler is given back."""
        dist.destroy_process_group(self._group)
        self._group = None
        if self._previous_sigint is not None and signal.getsignal(signal.SIGINT) == self.interrupt:
            signal.signal(signal.SIGINT, self._previous_sigint)
        self._previous_sigint = None


class HostSigtermStrategy:
    """Mixin, placed before a Lightning parallel strategy's class: its ranks agree on SIGTERM through a
    :class:`HostSigtermAgreement`, installed by ``setup`` (with more than one process) and closed by ``teardown``;
    ``timeout`` (the strategy's own) bounds the agreement's collectives too. ``stopped_together`` (the
    ``StoppedTogether`` offer) lets the crash checkpoint save from every rank once they have agreed."""

    def __init__(self, timeout: Optional[timedelta] = default_pg_timeout, **kwargs: Any) -> None:
        super().__init__(timeout=timeout, **kwargs)
        self._sigterm_timeout = timeout
        self._sigterm: Optional[HostSigtermAgreement] = None

    def setup(self, trainer: Trainer) -> None:
        super().setup(trainer)
        if self.world_size > 1 and self._sigterm is None:
            self._sigterm = HostSigtermAgreement.install(trainer, self._sigterm_timeout)

    def stopped_together(self) -> bool:
        return self._sigterm is not None and self._sigterm.agreed

    def teardown(self) -> None:
        if self._sigterm is not None:
            self._sigterm.close()
            self._sigterm = None
        super().teardown()
