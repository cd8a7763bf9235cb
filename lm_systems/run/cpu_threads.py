"""How many threads a run on the CPU computes with: one core fewer than torch would take, unless OMP_NUM_THREADS says.

Beside one other busy process, a thread of each parallel region waits for a descheduled one: the tiny default trained
five times slower with every core than with one left free, and on idle cores all of them were less than twice as fast
(docs/launching.md). The count is fixed per machine, not taken from the load, so that a resumed run computes as the
run it continues did.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

TORCH_THREADS = torch.get_num_threads()
"""torch's own count, before this module changes it (one per core, or what OMP_NUM_THREADS said)."""


def choose_cpu_threads(device_type: Optional[str]) -> None:
    """On a CPU run without ``OMP_NUM_THREADS``, compute with all of torch's threads but one (at least one)."""
    if device_type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, TORCH_THREADS - 1))
