"""How many threads a run on the CPU computes with: one core fewer than torch would take, unless told.

torch takes a thread per core. Beside one other busy process, a thread of each parallel region waits for a
descheduled one, and the tiny default trained five times slower than with a core left free; on idle cores, using
them all was less than twice as fast (docs/launching.md has the measurements). A CPU run therefore leaves a core to
whatever else runs. The count is fixed per machine, not taken from the load, so that a resumed run computes as the
run it continues did. ``OMP_NUM_THREADS`` chooses it instead.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

THREADS_ENV = "OMP_NUM_THREADS"
TORCH_THREADS = torch.get_num_threads()
"""torch's own count, before this module changes it (one per core, or what OMP_NUM_THREADS said)."""


def cpu_threads() -> int:
    """Threads for a CPU run: all of torch's but one, at least one."""
    return max(1, TORCH_THREADS - 1)


def choose_cpu_threads(device_type: Optional[str]) -> None:
    """On a CPU run without ``OMP_NUM_THREADS``, compute with ``cpu_threads()`` threads."""
    if device_type == "cpu" and THREADS_ENV not in os.environ:
        torch.set_num_threads(cpu_threads())
