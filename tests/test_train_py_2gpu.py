"""`python train.py --devices 2` on two GPUs over NCCL, run as the user runs it (a subprocess): every
data-parallel strategy in bf16-mixed and 16-mixed, clipping engaged, two micro-batches accumulated per step
(bucketed_ddp also compiled in runs of blocks that share a bucket).

Each run must exit 0 and lower the training loss. The replicated strategies' ranks must end with identical
weights. Every strategy must end where torch DDP (Lightning's ``ddp``) ends on the same windows (the
training windows are a function of seed, world size, rank and batch index, so two-process runs of every
strategy see the same batches): closer to it than a tenth of the distance DDP's weights travelled, which a
strategy that averaged nothing, or clipped each rank's own norm, would miss. A two-GPU run resumed from
a step checkpoint ends where the uninterrupted run ends, and SIGTERM stops both ranks (the strategies agree on it
over gloo beside NCCL). tests/test_train_py_4gpu.py runs the same tests on four GPUs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sigterm_run import FAILURES, rank_dies_after_first_checkpoint, sigterm_after_first_checkpoint
from test_train_py_gpu import assert_trained, logged, version_dir

from lm_systems.files.checkpoint_io import read_checkpoint

STEPS = 12
ZERO1_ALL_REDUCE = "zero1 --trainer.strategy.grad_reduce all_reduce"  # every rank keeps all averaged gradients
# The tiny model's four blocks in 2.5 MB buckets: compiled as two runs of two blocks, one graph each.
COMPILED_RUNS = "bucketed_ddp --model.compile buckets --trainer.strategy.bucket_size_mb 2.5"
REPLICATED = ["naive_ddp", "overlap_ddp", "bucketed_ddp", "zero1", ZERO1_ALL_REDUCE, COMPILED_RUNS]
SHARDED = ["zero3", "fsdp2"]
PRECISIONS = ["bf16-mixed", "16-mixed"]
CLIP = 0.05  # below the tiny model's gradient norm at these steps: every step clips (asserted below)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


@pytest.fixture(scope="module")
def devices() -> int:
    """GPUs a run takes (tests/test_train_py_4gpu.py runs this file's tests with 4)."""
    return 2


def train_py_on_gpus(train_py, run_dir: Path, cache_dir: Path, devices: int, *args: str) -> None:
    """One run (35-80 s on two H100s): the 600 s test limit holds two, as the DDP reference and a strategy's."""
    train_py.run_ok(
        "--devices",
        str(devices),
        "--max_steps",
        str(STEPS),
        "--accumulate_grad_batches",
        "2",
        "--trainer.gradient_clip_val",
        str(CLIP),
        "--trainer.val_check_interval",
        "6",
        "--trainer.log_every_n_steps",
        "2",
        "--trainer.enable_progress_bar",
        "false",
        "--model.sample_tokens",
        "8",
        "--data.cache_dir",
        str(cache_dir),
        "--trainer.callbacks+=tests.rank_weights.SaveRankWeights",
        f"--trainer.callbacks.out_dir={run_dir}",
        *args,
        cwd=run_dir,
        timeout=280,
    )


def checkpoint_weights(run_dir: Path, name: str = "last.ckpt") -> dict[str, torch.Tensor]:
    checkpoint = read_checkpoint(version_dir(run_dir) / "checkpoints" / name)
    return {k: v.float() for k, v in checkpoint["state_dict"].items() if k.startswith("model.")}


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return sum(((a[k] - b[k]) ** 2).sum().item() for k in a) ** 0.5


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, cache_dir, train_py, devices):
    """torch DDP's run in a precision (its folder also holds its initial weights), made once when first asked for."""
    runs: dict[str, Path] = {}

    def run(precision: str) -> Path:
        if precision not in runs:
            runs[precision] = tmp_path_factory.mktemp(f"ddp_{precision}")
            train_py_on_gpus(
                train_py, runs[precision], cache_dir, devices, "--strategy", "ddp", "--precision", precision
            )
        return runs[precision]

    return run


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("strategy", REPLICATED + SHARDED)
def test_strategy_trains_like_torch_ddp(strategy, precision, devices, tmp_path, cache_dir, ddp_run, train_py):
    if strategy == "fsdp2" and precision == "16-mixed":
        pytest.skip("Lightning's ModelParallelStrategy takes no 16-mixed (no sharded GradScaler)")
    train_py_on_gpus(train_py, tmp_path, cache_dir, devices, "--strategy", *strategy.split(), "--precision", precision)
    assert_trained(tmp_path)
    norms = logged(tmp_path, "train/grad_norm")
    assert min(norms) > CLIP, f"clipping must engage on every logged step: {norms}"
    if strategy in REPLICATED:
        replicas = [torch.load(tmp_path / f"weights_rank{rank}.pt", map_location="cpu") for rank in range(devices)]
        for name, weight in replicas[0].items():
            for rank, replica in enumerate(replicas[1:], start=1):
                assert torch.equal(weight, replica[name]), f"{name} differs between ranks 0 and {rank}"
    reference = checkpoint_weights(ddp_run(precision))
    ours = checkpoint_weights(tmp_path)
    travelled = distance(reference, _initial_weights(ddp_run(precision)))
    assert distance(ours, reference) < 0.1 * travelled, (distance(ours, reference), travelled)
    torch.testing.assert_close(
        torch.tensor(logged(tmp_path, "train/loss")),
        torch.tensor(logged(ddp_run(precision), "train/loss")),
        atol=2e-2,
        rtol=0,
    )


def _initial_weights(ddp_run: Path) -> dict[str, torch.Tensor]:
    """DDP's weights as training started (rank 0's, broadcast to every rank)."""
    state = torch.load(ddp_run / "initial_weights_rank0.pt", map_location="cpu")
    return {k: v.float() for k, v in state.items() if k.startswith("model.")}


@pytest.mark.parametrize("strategy", ["bucketed_ddp", "zero1", "zero3"])
@pytest.mark.timeout(900)  # three runs
def test_resume_ends_where_the_uninterrupted_run_ends(strategy, devices, tmp_path, cache_dir, train_py):
    whole, first, resumed = (tmp_path / name for name in ("whole", "first", "resumed"))
    for folder in (whole, first, resumed):
        folder.mkdir()
    common = ["--strategy", strategy, "--precision", "bf16-mixed", "--model.attention", "naive"]
    train_py_on_gpus(train_py, whole, cache_dir, devices, *common)
    train_py_on_gpus(train_py, first, cache_dir, devices, *common, "--checkpointing_interval", str(STEPS // 2))
    middle = version_dir(first) / "checkpoints" / f"step={STEPS // 2}.ckpt"
    train_py_on_gpus(train_py, resumed, cache_dir, devices, *common, "--ckpt_path", str(middle))
    assert read_checkpoint(version_dir(resumed) / "checkpoints" / "last.ckpt")["global_step"] == STEPS
    expected, got = checkpoint_weights(whole), checkpoint_weights(resumed)
    assert distance(got, expected) <= 1e-3 * distance(expected, checkpoint_weights(first, middle.name))


@pytest.mark.parametrize("strategy", ["bucketed_ddp", "zero3"])
def test_sigterm_stops_both_ranks_and_exits_143(strategy, train_py, tmp_path, cache_dir):
    sigterm_after_first_checkpoint(
        train_py,
        tmp_path,
        "--devices",
        "2",
        "--strategy",
        strategy,
        "--trainer.enable_progress_bar",
        "false",
        "--data.cache_dir",
        str(cache_dir),
    )


@pytest.mark.parametrize("failure", FAILURES)
def test_a_rank_that_dies_stops_the_run_in_one_line(failure, train_py, tmp_path, cache_dir):
    """Over NCCL, whose collectives wait out their timeout rather than fail when a peer is gone."""
    rank_dies_after_first_checkpoint(
        train_py,
        tmp_path,
        failure,
        *("--devices", "2", "--strategy", "bucketed_ddp", "--trainer.strategy.timeout", "0:01:00"),
        *("--trainer.enable_progress_bar", "false", "--data.cache_dir", str(cache_dir)),
    )
