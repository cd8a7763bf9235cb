"""Tuning once per machine: TunedKernel stores its choice in TuningCache, and a second process (or a second
kernel object) launches the stored config without timing anything. The kernels run in Triton's CPU
interpreter with a stand-in benchmark (tuning_worker.py, and ``_CountingBench`` here): the cache logic is
the same on a GPU, where triton.testing.do_bench times the candidates."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if sys.platform != "linux":
    pytest.skip("triton is installed on Linux only", allow_module_level=True)

import triton  # noqa: E402
from attention_reference import reference_attention, rel_error  # noqa: E402

from lm_systems.attention import tuning  # noqa: E402
from lm_systems.attention.flash_triton import FlashAttention2Triton  # noqa: E402
from lm_systems.attention.tuning import CACHE_ENV, TuningCache, default_cache_dir  # noqa: E402
from lm_systems.files.fingerprint import fingerprint  # noqa: E402

WORKER = Path(__file__).with_name("tuning_worker.py")
REPO = Path(__file__).resolve().parents[2]


def _start_worker(out: Path, bench_seconds: float = 0.0) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, str(WORKER), str(out), str(bench_seconds)], env=env)


def _worker_result(process: subprocess.Popen, out: Path) -> dict:
    assert process.wait(timeout=120) == 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_a_second_process_launches_the_stored_choice_without_timing(tmp_path, tuning_cache_dir):
    first = _worker_result(_start_worker(tmp_path / "first.json"), tmp_path / "first.json")
    second = _worker_result(_start_worker(tmp_path / "second.json"), tmp_path / "second.json")
    assert first == {"timed": 2, "block": 16}
    assert second == {"timed": 0, "block": 16}
    assert len(list(tuning_cache_dir.glob("*.json"))) == 1


@pytest.mark.slow
def test_two_processes_started_together_tune_once(tmp_path, tuning_cache_dir):
    # Each candidate's timing sleeps a second: the second process waits on the entry's lock, then reads it.
    outs = [tmp_path / "a.json", tmp_path / "b.json"]
    processes = [_start_worker(out, bench_seconds=1.0) for out in outs]
    results = [_worker_result(process, out) for process, out in zip(processes, outs, strict=True)]
    assert sorted(result["timed"] for result in results) == [0, 2]
    assert all(result["block"] == 16 for result in results)
    (entry,) = tuning_cache_dir.glob("*.json")
    assert json.loads(entry.read_text())["chosen"].startswith("BLOCK: 16")


@pytest.mark.slow
def test_off_tunes_in_every_process_and_writes_nothing(tmp_path, monkeypatch, tuning_cache_dir):
    monkeypatch.setenv(CACHE_ENV, "off")
    for name in ("first.json", "second.json"):
        assert _worker_result(_start_worker(tmp_path / name), tmp_path / name)["timed"] == 2
    assert not tuning_cache_dir.exists()


class _CountingBench:
    """Launches each candidate once (so it must run) and reports the candidates faster in the order given."""

    def __init__(self):
        self.calls = 0

    def __call__(self, launch) -> float:
        launch()
        self.calls += 1
        return 10.0 - self.calls


def _fresh_flash_kernels(monkeypatch, bench: _CountingBench) -> None:
    """flash_triton's eager kernels as a new process has them: nothing chosen yet; two interpreter candidates each
    (the default tiles and a second pair), so that there is something to tune."""
    second = {"fwd": (16, 16), "dq": (16, 16), "dkdv": (16, 16)}
    candidates = {
        kind: [config, triton.Config({"BLOCK_M": second[kind][0], "BLOCK_N": second[kind][1]})]
        for kind, config in tuning.INTERPRETER_CONFIG.items()
    }
    for kind, kernel in tuning.TUNED_FOR_EAGER.items():
        monkeypatch.setattr(kernel, "cache", {})
        monkeypatch.setattr(kernel, "bench", bench)
        monkeypatch.setattr(kernel, "prune", lambda configs, named, kind=kind: candidates[kind])


def _flash_matches_reference():
    q, k, v = (torch.randn(1, 2, 37, 16, requires_grad=True) for _ in range(3))
    out = FlashAttention2Triton.apply(q, k, v, True)
    out.backward(torch.ones_like(out))
    ref, _ = reference_attention(q.detach(), k.detach(), v.detach(), True)
    assert rel_error(out, ref) < 2e-5


def test_flash_triton_tunes_once_then_reads_its_choices_from_disk(monkeypatch, tuning_cache_dir):
    bench = _CountingBench()
    _fresh_flash_kernels(monkeypatch, bench)
    _flash_matches_reference()
    assert bench.calls == 6  # two candidates of each of the three tuned kernels
    assert len(list(tuning_cache_dir.glob("*.json"))) == 3
    chosen = {kind: dict(kernel.cache) for kind, kernel in tuning.TUNED_FOR_EAGER.items()}
    assert all(str(config).startswith("BLOCK_M: 16, BLOCK_N: 16") for c in chosen.values() for config in c.values())

    later = _CountingBench()
    _fresh_flash_kernels(monkeypatch, later)  # as a second process starts: nothing in memory
    _flash_matches_reference()
    assert later.calls == 0
    assert {kind: dict(kernel.cache) for kind, kernel in tuning.TUNED_FOR_EAGER.items()} == chosen


def test_a_damaged_entry_is_reported_and_tuned_again(monkeypatch, tuning_cache_dir):
    _fresh_flash_kernels(monkeypatch, _CountingBench())
    _flash_matches_reference()
    entries = sorted(tuning_cache_dir.glob("*.json"))
    entries[0].write_text('{"entry": {"kernel": ')  # cut short
    entries[1].write_text(json.dumps({"entry": "another", "chosen": "x"}))  # not this tuning's
    bench = _CountingBench()
    _fresh_flash_kernels(monkeypatch, bench)
    with pytest.warns(UserWarning, match="damaged tuning cache entry"):
        _flash_matches_reference()
    assert bench.calls == 4  # the two damaged entries' kernels, two candidates each
    for entry in entries:
        assert json.loads(entry.read_text())["chosen"].startswith("BLOCK_M: 16")


def test_the_entry_names_everything_the_choice_depends_on(tmp_path):
    cache = TuningCache(tmp_path)
    configs = [triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32})]
    base = dict(
        kernel="k",
        source="s1",
        device="NVIDIA H100 80GB HBM3 sm90",
        key=(16384, 64, True, "torch.bfloat16"),
        candidates=configs,
    )
    path = cache.path(TuningCache.entry(**base))
    for change in (
        dict(source="s2"),
        dict(device="NVIDIA H200 sm90"),
        dict(key=(8192, 64, True, "torch.bfloat16")),
        dict(candidates=configs[:1]),
    ):
        assert cache.path(TuningCache.entry(**{**base, **change})) != path, change
    assert TuningCache.entry(**base)["triton"] == triton.__version__


def test_the_kernel_source_hash_follows_the_kernel_files():
    from lm_systems.attention import flash_triton_backward, flash_triton_forward

    texts = [Path(module.__file__).read_text() for module in (flash_triton_forward, flash_triton_backward)]
    assert tuning.KERNEL_SOURCE == fingerprint(texts)
    assert fingerprint([texts[0] + "\n# an edit", texts[1]]) != tuning.KERNEL_SOURCE


def test_location_and_clear(monkeypatch, tmp_path):
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "lm_systems" / "triton_tuning"
    monkeypatch.setenv(CACHE_ENV, "off")
    assert default_cache_dir() is None
    cache = TuningCache(tmp_path / "c")
    entry = TuningCache.entry("k", "s", "cpu", (1,), [triton.Config({"B": 1}), triton.Config({"B": 2})])
    with cache.lock(entry):
        cache.put(entry, triton.Config({"B": 2}), {})
    assert cache.get(entry, [triton.Config({"B": 1}), triton.Config({"B": 2})]).kwargs == {"B": 2}
    assert cache.clear() == 1 and not list((tmp_path / "c").iterdir())
    assert TuningCache(tmp_path / "missing").clear() == 0


def test_tune_command_clears_and_names_what_it_needs(tmp_path, tuning_cache_dir, capsys):
    from lm_systems.attention import tune

    cache = TuningCache(tuning_cache_dir)
    entry = TuningCache.entry("k", "s", "cpu", (1,), [triton.Config({"B": 1}), triton.Config({"B": 2})])
    cache.put(entry, triton.Config({"B": 1}), {})
    tune.main(["--clear"])
    assert f"deleted 1 tuned choices from {tuning_cache_dir}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        tune.main([])  # nothing to do: the usage error names --seq
    assert "--seq" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="on a GPU"):
            tune.main(["--seq", "128"])
