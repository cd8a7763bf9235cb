"""After a two-process train.py run, once the default group is destroyed (Lightning's exit hook), no thread of any
process group is left in either rank: nothing the run built (containers, sharded optimizers, the SIGTERM agreement)
still holds one, so none lives into interpreter teardown."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("train_py_group_threads.py")


@pytest.mark.parametrize("strategy", ["zero1", "zero3"])
def test_no_group_thread_outlives_a_two_process_run(train_py, tmp_path, strategy):
    flags = ["--strategy", strategy, "--accelerator", "cpu", "--devices", "2", "--max_steps", "2"]
    flags += ["--trainer.logger", "false", "--trainer.enable_checkpointing", "false"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *train_py.tiny, *flags],
        cwd=tmp_path,
        env=train_py.environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    left = [json.loads(line.split(": ", 1)[1]) for line in done.stdout.splitlines() if "group threads left" in line]
    assert len(left) == 2, f"one line per rank expected:\n{done.stdout[-3000:]}"
    assert left == [{}, {}], f"threads of destroyed groups still running, per rank: {left}"
