"""Two "nodes" on one machine, started as a cluster launcher starts them (one process per node, the rank
environment set, gloo): for each of our strategies the replicas end equal and one checkpoint is written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins.environments.lightning import find_free_network_port

REPO = Path(__file__).resolve().parents[1]
TINY = ["--model.d_model", "32", "--model.num_layers", "1", "--model.num_heads", "2", "--model.d_ff", "64",
        "--model.context_length", "16", "--model.sample_prompt", "", "--data.generated_stories", "300",
        "--data.vocab_size", "300", "--data.batch_size", "2", "--data.val_batches", "2",
        "--trainer.val_check_interval", "2", "--trainer.enable_progress_bar", "false"]


def lightning_environment(node_rank: int, port: int) -> dict[str, str]:
    """What `srun`-less manual launching sets on each node (Lightning's LightningEnvironment reads it)."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": str(node_rank), "WORLD_SIZE": "2"}


def torchrun_environment(node_rank: int, port: int) -> dict[str, str]:
    """What `torchrun --nnodes 2 --nproc_per_node 1` sets on each node (TorchElasticEnvironment reads it)."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(node_rank), "LOCAL_RANK": "0",
            "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(node_rank), "TORCHELASTIC_RUN_ID": "test"}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("data_cache")


@pytest.mark.parametrize(
    "strategy, environment",
    [("naive_ddp", lightning_environment), ("overlap_ddp", lightning_environment),
     ("bucketed_ddp", lightning_environment), ("zero1", lightning_environment), ("bucketed_ddp", torchrun_environment)],
)
def test_two_nodes_train_to_equal_replicas_and_one_checkpoint(strategy, environment, tmp_path, cache_dir):
    port = find_free_network_port()
    command = [sys.executable, str(REPO / "train.py"), "--strategy", strategy, "--accelerator", "cpu",
               "--num_nodes", "2", "--devices", "1", "--max_steps", "3", *TINY, "--data.cache_dir", str(cache_dir),
               "--trainer.callbacks+=tests.rank_weights.SaveRankWeights", f"--trainer.callbacks.out_dir={tmp_path}"]
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE")}
    nodes = [
        subprocess.Popen(command, cwd=tmp_path, env={**base, "PYTHONPATH": str(REPO), **environment(rank, port)},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    for node, output in zip(nodes, outputs):
        assert node.returncode == 0, output[-4000:]
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in "".join(outputs)

    replicas = [torch.load(tmp_path / f"weights_rank{rank}.pt") for rank in (0, 1)]
    for name, weight in replicas[0].items():
        torch.testing.assert_close(replicas[1][name], weight, rtol=0, atol=0, msg=name)
    assert [p.name for p in (tmp_path / "logs" / "lm_systems").iterdir()] == ["version_0"], "one run folder"
    checkpoints = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.ckpt"))
    run = Path("logs", "lm_systems", "version_0", "checkpoints")
    assert checkpoints == [run / "last.ckpt", run / "step=3.ckpt"]
    saved = torch.load(tmp_path / run / "step=3.ckpt", weights_only=False)["state_dict"]
    for name, weight in replicas[0].items():
        torch.testing.assert_close(saved[name], weight, rtol=0, atol=0, msg=name)
