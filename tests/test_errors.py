"""Every bad input ends train.py in one line naming the flag, the value and what to change, with no traceback
unless --debug asks for one; a file that cannot be written is named with the free space."""

from __future__ import annotations

import contextlib
import errno
import re
import resource
import signal
from typing import Literal, Optional, Union

import pytest
from jsonargparse import ArgumentError, ArgumentParser

from lm_systems.data.datamodule import LMDataModule
from lm_systems.errors import DEBUG_ENV, InputError, one_line, os_error_in, write_error_message
from train import main

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI.s args parameter")  # pytest's own argv
QUIET = [
    "--trainer.limit_val_batches",
    "0",
    "--trainer.enable_model_summary",
    "false",
    "--trainer.enable_progress_bar",
    "false",
    "--max_steps",
    "1",
]


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(DEBUG_ENV, "")  # restored after a test that sets it (--debug)


@pytest.fixture
def fast(tiny_args, cache_dir) -> list[str]:
    """A one-step tiny run whose corpus, tokenizer and tokens are already in the session's cache (so that a test
    limiting file sizes fails on the checkpoint it writes, not on building them)."""
    LMDataModule(generated_stories=300, vocab_size=300, cache_dir=str(cache_dir)).prepare_data()
    return [*tiny_args, *QUIET]


def one_line_error(args: list[str], capsys, status: int = 2) -> str:
    """The error line of ``main(args)``, which must exit with ``status`` and print no traceback."""
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == status
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0] == err.strip().splitlines()[-1], err
    return errors[0]


BAD_BUCKET = "error: bucket_size_mb must be positive (or None to pick by the hosts), got -1.0 (strategy init_args."


@pytest.mark.parametrize(
    "args, says",
    [
        (["--devices", "-3"], "error: --devices (--trainer.devices) -3 is not a count > 0, -1 (all)"),
        (["--model.size", "huge"], "error: unknown model size 'huge' (set --model.size to one of: tiny, small"),
        (["--model.context_length", "0"], "error: --model.context_length must be positive, got 0"),
        (
            ["--trainer.strategy", "strategies.BucketedDDPStrategy", "--trainer.strategy.bucket_size_mb", "-1"],
            BAD_BUCKET,
        ),
        (["--strategy", "bucketed_ddp", "--trainer.strategy.bucket_size_mb", "-1"], BAD_BUCKET),
    ],
    ids=["devices", "size", "context", "bucket-class", "bucket-name"],
)
def test_bad_values_are_one_line(args, says, capsys, fast):
    assert one_line_error([*fast, *args], capsys).startswith(says)


def test_a_strategy_name_takes_init_arguments(monkeypatch, fast):
    def fit(self, model, train_dataloaders=None, val_dataloaders=None, datamodule=None, ckpt_path=None):
        """Build everything, train nothing."""

    monkeypatch.setattr("lightning.pytorch.Trainer.fit", fit)
    cli = main(
        [
            *fast,
            "--strategy",
            "bucketed_ddp_spawn",
            "--trainer.strategy.bucket_size_mb",
            "5",
            "--accelerator",
            "cpu",
            "--devices",
            "1",
        ]
    )
    strategy = cli.trainer.strategy
    assert type(strategy).__name__ == "BucketedDDPStrategy" and strategy._bucket_size_mb == 5
    assert strategy._start_method == "spawn"  # what the name was registered with


@pytest.mark.parametrize(
    "text, says",
    [
        ("model:\n  lr: [1\n", "is not valid YAML at line 3, column 1: expected ','"),
        ("- a\n- b\n", "holds a YAML list, not a mapping"),
    ],
)
def test_a_bad_config_file_is_named(tmp_path, capsys, text, says, fast):
    (tmp_path / "mine.yaml").write_text(text)
    line = one_line_error([*fast, "-c", "mine.yaml"], capsys)
    assert line.startswith(f"error: -c 'mine.yaml' {says}"), line


@pytest.mark.parametrize(
    "content",
    [b"one short line\n", b"caf\xe9 au lait\n", bytes(range(256)) * 4],
    ids=["shorter-than-context", "latin-1", "binary"],
)
def test_a_bad_corpus_is_one_line(tmp_path, capsys, fast, content):
    (tmp_path / "corpus.txt").write_bytes(content)
    line = one_line_error([*fast, "--data.corpus", "corpus.txt"], capsys)
    assert "--data.corpus 'corpus.txt'" in line
    assert ("lower --model.context_length" in line) if content.startswith(b"one") else ("is not UTF-8 text" in line)


def test_debug_keeps_the_traceback(tmp_path, fast):
    (tmp_path / "corpus.txt").write_bytes(b"caf\xe9 au lait\n")
    with pytest.raises(InputError, match="not UTF-8 text"):
        main([*fast, "--data.corpus", "corpus.txt", "--debug", "true"])


def test_an_unwritable_log_folder_is_named(tmp_path, capsys, fast):
    (tmp_path / "a_file").write_text("")  # a folder cannot be made inside it, whoever runs the test
    line = one_line_error([*fast, "--trainer.default_root_dir", "a_file/runs"], capsys)
    assert line.startswith("error: --trainer.default_root_dir 'a_file/runs' cannot be made (Not a directory)"), line


@contextlib.contextmanager
def files_limited_to(size: int):
    """Writes past ``size`` bytes fail (EFBIG), as on a full disk, and the process is not killed for them (SIGXFSZ)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


@pytest.fixture
def files_limited_to_100kb():
    with files_limited_to(100_000):
        yield


@pytest.mark.slow  # trains a step
def test_a_checkpoint_that_cannot_be_written_is_named_with_the_free_space(capsys, fast, files_limited_to_100kb):
    """torch.save fails with 'enforce fail at inline_container.cc' while handling the OSError that says why."""
    line = one_line_error(fast, capsys, status=1)
    assert line.startswith("error: cannot write '") and "step=1.ckpt': File too large (" in line, line
    assert "free on its filesystem); free some space or write elsewhere: --trainer.default_root_dir" in line


def test_a_cache_disk_filling_up_while_tokenizing_names_the_file_and_its_disk(tmp_path, capsys, tiny_args):
    cache = tmp_path / "cache"
    prepared = LMDataModule(generated_stories=300, vocab_size=300, cache_dir=str(cache))
    (prepared.token_splits.directory / "meta.json").unlink()  # corpus and tokenizer kept: only the tokens to build
    with files_limited_to(8_000):
        line = one_line_error([*tiny_args, *QUIET, "--data.cache_dir", str(cache)], capsys, status=1)
    work = prepared.token_splits.directory
    assert re.match(
        rf"error: cannot write '{re.escape(str(work))}/work-[0-9a-f]{{8}}/train.arrow': File too large \(", line
    ), line
    assert "B free on its filesystem)" in line, line  # of the named file's (write_error_message)


def test_the_os_error_behind_a_runtime_error_is_found(tmp_path):
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError(  # noqa: B904  as torch raises it: the OSError only the implicit context
                "[enforce fail at inline_container.cc:672] . unexpected pos 1866048 vs 1865936"
            )
    except RuntimeError as error:
        assert os_error_in(error).errno == errno.ENOSPC
    message = write_error_message(OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x.ckpt")))
    assert f"cannot write '{tmp_path / 'x.ckpt'}': No space left on device (" in message and "B free" in message


@pytest.mark.parametrize(
    "kind, value, says",
    [
        (Literal["none", "blocks"], "all", "--key 'all' is not one of: none, blocks"),
        (Optional[Union[Literal[16, 32], Literal["bf16-mixed"]]], "8-bit", "--key '8-bit' is not one of: bf16-mixed"),
        (Union[Literal["a"], int], "b", "--key 'b' is not one of: a"),  # an int is "Expected a <class 'int'>"
        (bool, "maybe", ("Parser key \"key\": Expected a <class 'bool'>. Got value: maybe",)),
        # jsonargparse's own words, whose order of the Union's members varies between its releases
        (Optional[int], "x", ('Parser key "key": ', "Expected a <class 'int'>", "Expected a <class 'NoneType'>")),
    ],
)
def test_jsonargparse_errors_are_one_line_and_a_bad_choice_lists_the_choices(kind, value, says):
    """jsonargparse's own error dumps, as a parser of it raises them: a Literal's choices (a Union's too, its
    type errors dropped) read as ``--key 'value' is not one of: ...``; any other error keeps jsonargparse's words
    (``says`` as a tuple: the words the one line holds)."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--key", type=kind)
    with pytest.raises(ArgumentError) as error:
        parser.parse_args(["--key", value])
    said = one_line(str(error.value))
    if isinstance(says, tuple):
        assert "\n" not in said and all(words in said for words in says), said
    else:
        assert said == says


@pytest.fixture
def no_interpreter(monkeypatch):
    """flash_triton as on a machine without TRITON_INTERPRET (the suite runs its kernels interpreted)."""
    monkeypatch.setattr("lm_systems.attention.tuning._INTERPRETING", False)


@pytest.mark.parametrize(
    "args, says",
    [
        (["--trainer.default_root_dir", "/proc/x"], "error: --trainer.default_root_dir '/proc/x' cannot be made ("),
        (["--data.cache_dir", "/proc/x"], "error: --data.cache_dir '/proc/x' cannot be made ("),
        (
            ["--accumulate_grad_batches", "0"],
            "error: --accumulate_grad_batches (--trainer.accumulate_grad_batches) 0 must be > 0",
        ),
        (
            ["--trainer.accumulate_grad_batches", "-2"],
            "error: --accumulate_grad_batches (--trainer.accumulate_grad_batches) -2 must be > 0",
        ),
        (["--trainer.val_check_interval", "0"], "error: --trainer.val_check_interval 0 must be > 0"),
        (["--trainer.val_check_interval", "0.0"], "error: --trainer.val_check_interval 0.0 must be > 0"),
        (["--devices", "abc"], "error: --devices (--trainer.devices) 'abc' is not a count > 0, -1 (all), 'auto'"),
        (
            ["--model.attention", "flash_triton", "--accelerator", "cpu"],
            "error: --model.attention flash_triton cannot run on --accelerator cpu (cpu): its Triton kernels need "
            "a CUDA",
        ),
        (
            ["--data.synthetic", "true", "--data.vocab_size", "0"],
            "error: --data.vocab_size 0 is not a vocabulary: synthetic tokens need at least 2 ids",
        ),
        (
            ["--data.synthetic", "true", "--data.vocab_size", "1000000000"],
            "error: --data.vocab_size 1000000000 is past what the model can embed here: its embedding and LM head at "
            "d_model 32 need 1,024 GB",
        ),
        (
            ["--data.synthetic", "true", "--data.corpus", "stories.txt"],
            "error: --data.corpus 'stories.txt' is not read with --data.synthetic true (random token ids)",
        ),
    ],
    ids=[
        "root-dir",
        "cache-dir",
        "accumulate",
        "accumulate-negative",
        "val-interval",
        "val-interval-float",
        "devices",
        "flash-triton-on-cpu",
        "synthetic-vocab-0",
        "synthetic-vocab-1e9",
        "corpus-with-synthetic",
    ],
)
def test_bad_values_stop_before_the_data_is_prepared(args, says, capsys, tiny_args, tmp_path, no_interpreter):
    cache = tmp_path / "fresh_cache"
    line = one_line_error([*tiny_args, *QUIET, "--data.cache_dir", str(cache), *args], capsys)
    assert line.startswith(says), line
    assert not cache.exists() or not any(cache.iterdir()), "the data was prepared before the error"
    assert not (tmp_path / "logs").exists(), "a TensorBoard run was left behind"
