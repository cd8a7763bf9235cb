"""``python tests/train_py_group_threads.py ARGS``: train.py's ``main(ARGS)`` (Lightning's popen launcher re-runs this
script for the other ranks), then the default group destroyed, as Lightning's exit hook does; each rank then prints the
process-group threads it still has, as one line of JSON: ``group threads left: {...}``."""

import json
import os
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import torch.distributed as dist  # noqa: E402
from group_threads import group_threads  # noqa: E402

import train  # noqa: E402

train.main(sys.argv[1:])
if dist.is_initialized():
    dist.destroy_process_group()
os.write(1, f"group threads left: {json.dumps(dict(group_threads()))}\n".encode())  # one write: ranks share stdout
