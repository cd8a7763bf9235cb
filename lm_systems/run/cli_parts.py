"""What the packages built on lm_systems hand its command line: their strategy names, callbacks and progress bar."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

from lightning.pytorch.callbacks import Callback, ProgressBar


@dataclass(frozen=True)
class CLIParts:
    """Handed in by the entry point (``train.py``), so that lm_systems imports nothing built on top of it.

    Attributes:
        strategy_names: names the caller registered in Lightning's StrategyRegistry before the CLI starts; an
            unknown ``--strategy`` lists them first.
        callbacks: makes the callbacks every run gets (each unless the configuration brings one of its type).
        progress_bar: makes the progress bar for a refresh rate in batches; None keeps Lightning's.
    """

    strategy_names: Sequence[str] = ()
    callbacks: Callable[[], list[Callback]] = list
    progress_bar: Optional[Callable[[int], ProgressBar]] = None
