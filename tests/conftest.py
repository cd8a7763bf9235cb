"""Shared test setup: the `gpu` marker skips without CUDA; tests that start processes (two spawned ranks, train.py
as a subprocess) are marked `slow`; Triton kernels run interpreted on the CPU; every test leaves the environment
and Lightning's log filters as it found them.

Fixtures for every test folder: ``cache_dir`` (one data cache per session), ``spawn_two_ranks`` (two gloo ranks),
``tiny_args`` (a tiny train.py run's flags), ``train_py`` (train.py in a subprocess, killed if it outlives its test),
``greedy_text`` (argmax decoding) and ``assert_same_training_state`` (two checkpoints, bit for bit)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from environment import environment_kept

REPO = Path(__file__).resolve().parents[1]

# Must be set before triton is imported anywhere, so CPU runs can exercise the kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

SLOW_FIXTURES = {"spawn_two_ranks", "train_py"}  # two fresh interpreters, or train.py's start-up and its run


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SLOW_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


_SESSION_ENVIRONMENT = dict(os.environ)
_SEED_VARIABLES = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")


@pytest.fixture(autouse=True)
def _restore_environment():
    """Each test starts with the session's seed variables (a fixture of a wider scope that changed them fails the
    test naming them) and leaves the environment as it found it. ``train.main`` adds a filter to Lightning's
    rank-zero logger at each call and sets torch's CPU threads: those are restored too."""
    leaked = [name for name in _SEED_VARIABLES if os.environ.get(name) != _SESSION_ENVIRONMENT.get(name)]
    assert not leaked, f"a module- or session-scoped fixture left {leaked} in os.environ: wrap it in environment_kept()"
    rank_zero_logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    filters, threads = list(rank_zero_logger.filters), torch.get_num_threads()
    with environment_kept():
        yield
    rank_zero_logger.filters[:] = filters
    torch.set_num_threads(threads)  # a CPU run through train.main chooses its own


@pytest.fixture
def lightning_log(caplog, monkeypatch):
    """``caplog``, also holding what Lightning's rank-zero logger says: Lightning's loggers stop propagating to the
    root logger once Lightning is set up, so caplog alone sees them or not depending on the tests run before."""
    rank_zero_logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    monkeypatch.setattr(rank_zero_logger, "handlers", [*rank_zero_logger.handlers, caplog.handler])
    monkeypatch.setattr(rank_zero_logger, "propagate", False)  # the handler above, not the root's too: no doubles
    caplog.set_level(logging.INFO, logger=rank_zero_logger.name)
    return caplog


@pytest.fixture
def single_rank_group():
    """A one-process gloo group in this process, destroyed afterwards."""
    # Imported here: Lightning imports triton, which must come after TRITON_INTERPRET is set above.
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{find_free_network_port()}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=60),
    )
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """The generated corpus, tokenizers and token caches: built by the first test that asks, reused by the others
    (entries are keyed by corpus and tokenizer settings, so tests with other settings get their own)."""
    return tmp_path_factory.mktemp("data_cache")


def _spawn_two_ranks(worker, out_dir, *args) -> None:
    """Run ``worker(rank, 2, port, str(out_dir), *args)`` on two spawned processes; a failure in either fails the
    test. The worker creates its process group (with a timeout) and destroys it."""
    # Imported here: Lightning imports triton, which must see TRITON_INTERPRET (set above) first.
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    mp.spawn(worker, args=(2, find_free_network_port(), str(out_dir), *args), nprocs=2, join=True)


@pytest.fixture(scope="session")
def spawn_two_ranks():
    return _spawn_two_ranks


def _greedy_text(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """``prompt`` continued by plain argmax decoding (one whole forward per token, stopping at <|endoftext|>), decoded:
    what ``sampling.sample_text(..., temperature=0)`` must print, computed without it. Decoded as samples are printed
    (``printable_decode``, which tests/data/test_printable.py checks on its own)."""
    from lm_systems.data.printable import printable_decode

    ids = tokenizer.encode(prompt).ids
    prompt_length, eot_id = len(ids), tokenizer.token_to_id("<|endoftext|>")
    model.eval()
    with torch.no_grad():
        for _ in range(max_new_tokens):
            next_id = int(model(torch.tensor([ids[-model.config.context_length :]]))[0, -1].argmax())
            if next_id == eot_id:
                break
            ids.append(next_id)
    assert len(ids) > prompt_length, "the model stopped at once: the check would compare the prompt with itself"
    return printable_decode(tokenizer, ids)


@pytest.fixture(scope="session")
def greedy_text():
    return _greedy_text


def _assert_equal_nested(actual, expected, where: str) -> None:
    if isinstance(expected, torch.Tensor):
        same = isinstance(actual, torch.Tensor) and torch.equal(actual, expected)
        assert same, f"{where} differs" + (
            f" by up to {(actual - expected).abs().max().item():.3g}"
            if same is False and actual.shape == expected.shape
            else ""
        )
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys(), where
        for key in expected:
            _assert_equal_nested(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
            _assert_equal_nested(a, e, f"{where}[{index}]")
    else:
        assert actual == expected, where


TRAINING_STATE = ("global_step", "state_dict", "optimizer_states", "lr_schedulers", "LMDataModule")
"""What a checkpoint holds of training: step, weights, optimizer, schedule and the data position."""


def _assert_same_training_state(actual: dict, expected: dict) -> None:
    """Two checkpoints' TRAINING_STATE equal, tensors bit for bit (``torch.equal``)."""
    for key in TRAINING_STATE:
        _assert_equal_nested(actual[key], expected[key], key)


@pytest.fixture(scope="session")
def assert_same_training_state():
    return _assert_same_training_state


TINY = [
    "--model.d_model",
    "32",
    "--model.num_layers",
    "1",
    "--model.num_heads",
    "2",
    "--model.d_ff",
    "64",
    "--model.context_length",
    "16",
    "--model.sample_prompt",
    "",
    "--data.generated_stories",
    "300",
    "--data.vocab_size",
    "300",
    "--data.batch_size",
    "2",
    "--data.val_batches",
    "1",
]
"""A train.py run of a tiny model on the generated corpus, without the closing sample."""


@pytest.fixture(scope="session")
def tiny_args(cache_dir) -> list[str]:
    """TINY for ``train.main`` in this process, on the session's data cache (copy it to add flags)."""
    return [*TINY, "--data.cache_dir", str(cache_dir)]


# What this process's test setup put in its environment, which a train.py run must not inherit.
_NOT_INHERITED = (
    "TRITON_INTERPRET",
    "PL_GLOBAL_SEED",
    "PL_SEED_WORKERS",
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


class TrainPy:
    """Starts ``python train.py`` from the checkout (``tests.*`` importable, for callbacks) in a session of its own,
    so that it and the ranks it launches are killed together if the test fails or times out."""

    def __init__(self, cache_dir: Path) -> None:
        self.tiny = [*TINY, "--data.cache_dir", str(cache_dir), "--trainer.enable_progress_bar", "false"]

    @staticmethod
    def environment(**extra: str) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED}
        return {**base, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])), **extra}

    @contextmanager
    def start(
        self, *args: str, cwd: Path, env: dict[str, str] | None = None, launcher: Sequence[str] = ()
    ) -> Iterator[subprocess.Popen]:
        """``python [launcher] train.py args`` running (``launcher``: say ``-m torch.distributed.run --nnodes 2 ...``);
        killed, with every process it started, on leaving the block if still alive."""
        process = subprocess.Popen(
            [sys.executable, *launcher, str(REPO / "train.py"), *args],
            cwd=cwd,
            env=env or self.environment(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            yield process
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            process.stdout.close()
            process.stderr.close()

    def run(
        self, *args: str, cwd: Path, timeout: float = 300, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        """``train.py args`` to its end (killed after ``timeout`` seconds): exit code, stdout, stderr."""
        with self.start(*args, cwd=cwd, env=env) as process:
            out, err = process.communicate(timeout=timeout)
        return subprocess.CompletedProcess(process.args, process.returncode, out, err)

    def run_ok(
        self, *args: str, cwd: Path, timeout: float = 300, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        """As ``run``, which must exit 0."""
        done = self.run(*args, cwd=cwd, timeout=timeout, env=env)
        assert done.returncode == 0, f"train.py {' '.join(args)}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
        return done


@pytest.fixture(scope="session")
def train_py(cache_dir) -> TrainPy:
    return TrainPy(cache_dir)
