"""Cutting an ordered list of sizes into consecutive stages of about equal total size (a pipeline's stages)."""

from __future__ import annotations


def cut_into_stages(sizes: list[int], stages: int) -> list[int]:
    """The stage (0 … stages-1) of each item when items of ``sizes``, in order, are cut into ``stages`` consecutive
    runs of about equal total size: an item goes where its middle falls, so stages never split one."""
    total = sum(sizes)
    before, assigned = 0, []
    for size in sizes:
        assigned.append(min(stages - 1, int((before + size / 2) * stages / total)) if total else 0)
        before += size
    return assigned
