"""`python train.py --help` from the help cache: the same text as the parser's, without importing Lightning, and
a new text whenever a source file, library version or terminal width changes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lm_systems.run import help_cache
from lm_systems.run.help_cache import cache_key, is_help_request, run_with_help_cache

REPO = Path(__file__).resolve().parents[1]


def _help(tmp_path: Path, *python_flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "COLUMNS": "100"}
    return subprocess.run(
        [sys.executable, *python_flags, str(REPO / "train.py"), "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
        check=True,
    )


@pytest.mark.slow
def test_second_help_is_the_same_text_without_lightning(tmp_path):
    first = _help(tmp_path)
    assert "--strategy" in first.stdout and "--model.size" in first.stdout
    assert len(list((tmp_path / "lm_systems" / "help").glob("*.txt"))) == 1
    second = _help(tmp_path, "-X", "importtime")  # lists every module the process imports, on stderr
    assert second.stdout == first.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in second.stderr.splitlines() if "|" in line}
    assert "lm_systems.run.help_cache" in imported
    assert not {name for name in imported if name.split(".")[0] in ("lightning", "torch", "jsonargparse")}


def test_only_help_requests_are_cached():
    for args in (["--help"], ["-h"], ["fit", "--help"], ["validate", "-h"]):
        assert is_help_request(args), args
    for args in ([], ["--max_steps", "3"], ["-c", "configs/small.yaml", "--help"], ["--help", "--help"], ["fit"]):
        assert not is_help_request(args), args


def test_key_follows_sources_arguments_and_width(tmp_path, monkeypatch):
    (tmp_path / "lm_systems").mkdir()
    source = tmp_path / "lm_systems" / "lit_module.py"
    source.write_text("class LitLM: ...\n")
    (tmp_path / "train.py").write_text("")
    monkeypatch.setenv("COLUMNS", "100")
    key = cache_key(["--help"], tmp_path)
    assert cache_key(["--help"], tmp_path) == key
    assert cache_key(["-h"], tmp_path) != key
    source.write_text("class LitLM:\n    '''A new docstring.'''\n")
    changed = cache_key(["--help"], tmp_path)
    assert changed != key
    (tmp_path / "strategies").mkdir()
    (tmp_path / "strategies" / "new.py").write_text("")
    assert cache_key(["--help"], tmp_path) != changed
    monkeypatch.setenv("COLUMNS", "80")
    assert cache_key(["--help"], tmp_path) not in (key, changed)


def test_help_text_is_stored_once_and_failures_never(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(help_cache, "cache_dir", lambda: tmp_path)
    calls = []

    def parser_help():
        calls.append(1)
        print("usage: train.py [options]")
        raise SystemExit(0)

    for _ in range(2):
        with pytest.raises(SystemExit) as done:
            run_with_help_cache(["--help"], parser_help)
        assert done.value.code == 0
        assert capsys.readouterr().out == "usage: train.py [options]\n"
    assert len(calls) == 1  # the second answer came from the cache

    def parser_error():
        print("error: something")
        raise SystemExit(2)

    with pytest.raises(SystemExit):
        run_with_help_cache(["-h"], parser_error)
    assert capsys.readouterr().out == "error: something\n"
    assert len(list(tmp_path.glob("*.txt"))) == 1  # only the good --help

    ran = []
    run_with_help_cache(["--max_steps", "3"], lambda: ran.append(1))
    assert ran == [1] and len(list(tmp_path.glob("*.txt"))) == 1
