"""Cutting an ordered list of sizes into consecutive runs of about equal total size (pipeline stages)."""

from __future__ import annotations


def cut_into_runs(sizes: list[int], parts: int) -> list[int]:
    """The run (0 … parts-1) of each item when items of ``sizes``, in order, are cut into ``parts`` runs of
    about equal total size: an item goes where its middle falls, so runs are consecutive and never split one."""
    total = sum(sizes)
    before, runs = 0, []
    for size in sizes:
        runs.append(min(parts - 1, int((before + size / 2) * parts / total)) if total else 0)
        before += size
    return runs
