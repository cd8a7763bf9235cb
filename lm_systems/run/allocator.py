"""The CUDA caching allocator's settings for a run: expandable segments, unless the user chose settings of their own.

A long-context step frees and allocates tensors of many sizes; the allocator's fixed-size segments then hold memory
that no request fits (fragmentation: docs/memory_budget.md has what it cost the 8B step). Expandable segments grow one
mapping instead, the setting torchtitan runs with. The allocator reads it once, when CUDA first allocates: ``train.py``
sets it before anything touches CUDA, and the ranks it launches inherit it with the environment.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import Optional

ALLOCATOR_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
"""Where torch reads the allocator's settings (the second is the newer, device-neutral name)."""
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def allocator_setting(environ: MutableMapping[str, str], cuda_build: bool) -> Optional[tuple[str, str]]:
    """The variable to set and its value for a run of this torch build in ``environ``: none where torch has no CUDA
    or the user set the allocator's settings already."""
    if not cuda_build or any(name in environ for name in ALLOCATOR_VARIABLES):
        return None
    return ALLOCATOR_VARIABLES[0], EXPANDABLE_SEGMENTS


def use_expandable_segments(environ: Optional[MutableMapping[str, str]] = None) -> None:
    """Set ``allocator_setting`` in ``environ`` (the process's own by default); call before CUDA is used."""
    import torch  # imported here: train.py's --help is answered without torch

    environ = os.environ if environ is None else environ
    setting = allocator_setting(environ, cuda_build=torch.version.cuda is not None)
    if setting is not None:
        environ[setting[0]] = setting[1]
