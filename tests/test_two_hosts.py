"""Two hosts of two processes each, simulated on one machine over gloo, started as docs/launching.md says: by
torchrun, one agent per node with node ranks 0 and 1 and a static rendezvous on localhost, and by a SLURM job step
(four tasks, each given SLURM's variables as `srun` sets them). Both runs train like the one-process replay of the
four ranks' batches, which one host's `--devices 4` matches too (tests/test_train_py_four_processes.py), and the
strategy picks its across-hosts bucket cap.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import pytest
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from replay_check import assert_trained_like_replay
from test_train_py_four_processes import TRAINING
from test_train_py_two_processes import CLIP, record_into

from lm_systems.parallel.bucketed import ACROSS_HOSTS_BUCKET_MB

NODES, PER_NODE = 2, 2
HOSTS = ["--num_nodes", str(NODES), "--devices", str(PER_NODE)]


def run_together(train_py, run_dir: Path, args: list[str], starts: list[dict]) -> str:
    """``train.py args`` once per entry of ``starts`` (``start``'s keyword arguments), all at once; their output."""
    with ExitStack() as running:  # every process is killed if one fails or outlives the wait
        processes = [running.enter_context(train_py.start(*args, cwd=run_dir, **start)) for start in starts]
        outputs = [process.communicate(timeout=300) for process in processes]
    for process, (out, err) in zip(processes, outputs, strict=True):
        assert process.returncode == 0, (out + err)[-4000:]
    return "".join(out + err for out, err in outputs)


def torchrun(node_rank: int, port: int) -> list[str]:
    return [
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(NODES),
        "--nproc_per_node",
        str(PER_NODE),
        "--node_rank",
        str(node_rank),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(port),
    ]


def slurm_task(train_py, rank: int, port: int) -> dict[str, str]:
    """What `srun` sets for task ``rank`` of a job step on two nodes of two tasks (Lightning's SLURMEnvironment)."""
    return train_py.environment(
        SLURM_JOB_NAME="lm_systems",
        SLURM_JOB_ID="50",
        SLURM_NNODES=str(NODES),
        SLURM_NTASKS=str(NODES * PER_NODE),
        SLURM_NTASKS_PER_NODE=str(PER_NODE),
        SLURM_PROCID=str(rank),
        SLURM_LOCALID=str(rank % PER_NODE),
        SLURM_NODEID=str(rank // PER_NODE),
        SLURM_NODELIST="127.0.0.1",
        MASTER_PORT=str(port),
    )


@pytest.mark.parametrize("launch, strategy", [("torchrun", "bucketed_ddp"), ("slurm", "zero1")])
def test_two_hosts_train_like_one_process_and_bucket_for_hosts(launch, strategy, train_py, tmp_path):
    args = [*train_py.tiny, *TRAINING, *HOSTS, "--strategy", strategy, *record_into(tmp_path)]
    port = find_free_network_port()
    if launch == "torchrun":
        starts = [{"launcher": torchrun(node, port)} for node in range(NODES)]
    else:
        starts = [{"env": slurm_task(train_py, rank, port)} for rank in range(NODES * PER_NODE)]
    output = run_together(train_py, tmp_path, args, starts)
    assert "GLOBAL_RANK: 3, MEMBER: 4/4" in output
    assert f"{strategy}: gradients averaged in 1 bucket(s) of at most {ACROSS_HOSTS_BUCKET_MB:g} MB" in output
    assert_trained_like_replay(tmp_path, world_size=NODES * PER_NODE, clip=float(CLIP))
    assert [p.name for p in (tmp_path / "logs" / "lm_systems").iterdir()] == ["version_0"], "one run folder"
