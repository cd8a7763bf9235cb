"""Lightning callbacks for profiling training: NVTX ranges, CUDA memory snapshots, step timing, tokens/s and MFU
(and the step-bounded progress bar and the garbage-collector freeze train.py uses).

Each takes typed keyword arguments, so LightningCLI can build it from YAML or the command line:
``--trainer.callbacks+=callbacks.StepTimer --trainer.callbacks.warmup_steps=2``.
"""

from lightning.pytorch.callbacks import Callback

from callbacks.gc_freeze import GCFreeze
from callbacks.memory_snapshot import MemorySnapshot
from callbacks.nvtx_ranges import NVTXRanges
from callbacks.progress import StepsProgressBar
from callbacks.step_timing import StepTimer
from callbacks.throughput import MFUMonitor


def every_run_callbacks() -> list[Callback]:
    """The callbacks train.py gives every run (each unless the configuration brings its own): MFU and the garbage
    collector's freeze."""
    return [MFUMonitor(), GCFreeze()]


__all__ = [
    "GCFreeze",
    "MFUMonitor",
    "MemorySnapshot",
    "NVTXRanges",
    "StepTimer",
    "StepsProgressBar",
    "every_run_callbacks",
]
