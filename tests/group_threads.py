"""The threads of this process that belong to a torch.distributed process group, as the kernel names them."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

GROUP_THREAD_PREFIXES = ("gloo", "pt_gloo", "pt_tcpstore")  # gloo's loops and the TCPStore's


def group_threads() -> Counter[str]:
    """This process's threads of gloo groups and TCPStores, by name (listed in ``/proc/self/task/*/comm``)."""
    names = Counter()
    for comm in Path("/proc/self/task").glob("*/comm"):
        try:
            name = comm.read_text().strip()
        except OSError:  # the thread ended while listed
            continue
        if name.startswith(GROUP_THREAD_PREFIXES):
            names[name] += 1
    return names
