"""Two "nodes" on one machine, started as a cluster launcher starts them (one process per node, the rank
environment set, gloo): for each of our strategies the run trains as one process would on both nodes' batches,
the replicas end equal, and one checkpoint of them is written."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from run_record import load_records, replay

from lm_systems.files.checkpoint_io import read_checkpoint


def lightning_environment(node_rank: int, port: int) -> dict[str, str]:
    """What `srun`-less manual launching sets on each node (Lightning's LightningEnvironment reads it)."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": str(node_rank), "WORLD_SIZE": "2"}


def torchrun_environment(node_rank: int, port: int) -> dict[str, str]:
    """What `torchrun --nnodes 2 --nproc_per_node 1` sets on each node (TorchElasticEnvironment reads it)."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(node_rank),
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "1",
        "GROUP_RANK": str(node_rank),
        "TORCHELASTIC_RUN_ID": "test",
    }


@pytest.mark.parametrize(
    "strategy, environment",
    [
        ("naive_ddp", lightning_environment),
        ("overlap_ddp", lightning_environment),
        ("bucketed_ddp", lightning_environment),
        ("zero1", lightning_environment),
        ("bucketed_ddp", torchrun_environment),
    ],
)
def test_two_nodes_train_to_equal_replicas_and_one_checkpoint(strategy, environment, tmp_path, train_py):
    port = find_free_network_port()
    args = [
        *train_py.tiny,
        "--strategy",
        strategy,
        "--accelerator",
        "cpu",
        "--num_nodes",
        "2",
        "--devices",
        "1",
        "--max_steps",
        "3",
        "--data.val_batches",
        "2",
        "--trainer.val_check_interval",
        "2",
        "--trainer.callbacks+=tests.run_record.RecordRun",
        f"--trainer.callbacks.out_dir={tmp_path}",
    ]
    with ExitStack() as running:  # both nodes are killed if either fails or outlives the wait
        nodes = [
            running.enter_context(
                train_py.start(*args, cwd=tmp_path, env=train_py.environment(**environment(rank, port)))
            )
            for rank in (0, 1)
        ]
        outputs = [node.communicate(timeout=300) for node in nodes]
    for node, (out, err) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, (out + err)[-4000:]
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in "".join(out + err for out, err in outputs)

    records = load_records(tmp_path)
    assert [record["world_size"] for record in records] == [2, 2]
    reference = replay(records)["state_dict"]
    assert [p.name for p in (tmp_path / "logs" / "lm_systems").iterdir()] == ["version_0"], "one run folder"
    checkpoints = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.ckpt"))
    run = Path("logs", "lm_systems", "version_0", "checkpoints")
    assert checkpoints == [run / "last.ckpt", run / "step=3.ckpt"]
    saved = read_checkpoint(tmp_path / run / "step=3.ckpt")["state_dict"]
    assert saved.keys() == reference.keys()
    for name, weight in reference.items():
        assert not torch.equal(weight, records[0]["initial"][name]), f"{name} never moved"
        # float32: the two nodes' mean gradients averaged vs one mean over both batches
        # (tests/test_train_py_two_processes.py)
        torch.testing.assert_close(saved[name], weight, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
        for record in records:
            assert torch.equal(record["final"][name], saved[name]), name
