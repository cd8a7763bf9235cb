"""The token cache: built once, reused, rebuilt when the corpus or tokenizer changes, never trusted half-written."""

from __future__ import annotations

import multiprocessing
import time

import numpy as np
import pytest

from lm_systems.data import preparation, token_cache
from lm_systems.data.datamodule import LMDataModule
from lm_systems.data.token_cache import build_token_cache, token_dtype
from lm_systems.data.tokenizer import END_OF_TEXT, save_tokenizer, train_bpe_tokenizer


def prepare(corpus, cache_dir, **kwargs) -> LMDataModule:
    module = LMDataModule(corpus=str(corpus), cache_dir=str(cache_dir), vocab_size=300, **kwargs)
    module.prepare_data()
    return module


def test_second_prepare_reuses_tokenizer_and_tokens(txt_corpus, tmp_path, build_calls):
    first = prepare(txt_corpus, tmp_path / "cache")
    train_file = first.token_splits.path("train")
    mtime = train_file.stat().st_mtime_ns
    assert build_calls == {"tokenizer": 1, "tokens": 1}

    second = prepare(txt_corpus, tmp_path / "cache")
    assert build_calls == {"tokenizer": 1, "tokens": 1}, "a rerun must not retrain or re-tokenize"
    assert train_file.stat().st_mtime_ns == mtime
    assert second.vocab_size == first.vocab_size
    np.testing.assert_array_equal(second.token_splits.tokens("train"), first.token_splits.tokens("train"))


def test_changed_corpus_is_tokenized_again(txt_corpus, tmp_path, build_calls):
    first = prepare(txt_corpus, tmp_path / "cache").token_splits.tokens("train")
    with open(txt_corpus, "a", encoding="utf-8") as file:
        file.write(f"A brand new story about a zebra.\n{END_OF_TEXT}")
    second = prepare(txt_corpus, tmp_path / "cache").token_splits.tokens("train")
    assert build_calls == {"tokenizer": 2, "tokens": 2}
    assert len(second) > len(first)


def test_changed_tokenizer_is_a_new_entry(txt_corpus, tmp_path, documents, build_calls):
    paths = []
    for vocab_size in (290, 310):
        tokenizer_file = save_tokenizer(train_bpe_tokenizer(documents, vocab_size), tmp_path / f"tok{vocab_size}.json")
        module = prepare(txt_corpus, tmp_path / "cache", tokenizer=str(tokenizer_file))
        assert module.vocab_size == vocab_size
        paths.append(module.token_splits.directory)
    assert build_calls["tokens"] == 2 and paths[0] != paths[1]


def test_entry_without_meta_is_rebuilt(txt_corpus, tmp_path, build_calls):
    module = prepare(txt_corpus, tmp_path / "cache")
    expected = np.array(module.token_splits.tokens("validation"))
    (module.token_splits.directory / token_cache.META_FILE).unlink()
    rebuilt = prepare(txt_corpus, tmp_path / "cache")
    assert build_calls["tokens"] == 2
    np.testing.assert_array_equal(rebuilt.token_splits.tokens("validation"), expected)


def test_a_killed_builds_work_folder_is_removed_by_the_next_build(txt_corpus, tmp_path, build_calls):
    entry = prepare(txt_corpus, tmp_path / "cache").token_splits.directory
    killed = entry / "work-0123abcd"  # what SIGTERM mid-tokenizing leaves: datasets' map output, no meta.json
    killed.mkdir()
    (killed / "train.arrow").write_bytes(b"partial")
    (entry / token_cache.META_FILE).unlink()
    prepare(txt_corpus, tmp_path / "cache")
    assert build_calls["tokens"] == 2 and not killed.exists()
    assert not list(entry.glob("work-*"))


def test_crash_before_meta_leaves_nothing_trusted(txt_corpus, tmp_path, monkeypatch):
    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(token_cache, "write_checked_json", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare(txt_corpus, tmp_path / "cache")
    entries = list((tmp_path / "cache" / "tokens").iterdir())
    assert len(entries) == 1
    assert sorted(p.name for p in entries[0].iterdir()) == ["train.npy", "validation.npy"], "work files must be removed"
    assert token_cache.open_token_cache(entries[0]) is None


def test_generated_corpus_is_cached_by_its_parameters(tmp_path, build_calls):
    a = prepare("generated", tmp_path / "cache", generated_stories=40, seed=1)
    prepare("generated", tmp_path / "cache", generated_stories=40, seed=1)
    b = prepare("generated", tmp_path / "cache", generated_stories=40, seed=2)
    assert build_calls == {"tokenizer": 2, "tokens": 2}
    assert len(list((tmp_path / "cache" / "corpora").glob("*.txt"))) == 2
    assert a.token_splits.tokens("train").tolist() != b.token_splits.tokens("train").tolist()


def _prepare_and_report(corpus, cache_dir, builds_log, queue) -> None:
    def logged_build(*args, **kwargs):
        with open(builds_log, "a") as log:
            log.write("build\n")
        time.sleep(1.0)  # widens the race: without the lock, the other process would start its own build
        return build_token_cache(*args, **kwargs)

    preparation.build_token_cache = logged_build  # in this forked process only
    module = prepare(corpus, cache_dir)
    queue.put((module.vocab_size, module.token_splits.tokens("train").tolist()))


@pytest.mark.slow
def test_concurrent_processes_build_the_cache_once(txt_corpus, tmp_path):
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    log = tmp_path / "builds.log"
    workers = [
        context.Process(target=_prepare_and_report, args=(txt_corpus, tmp_path / "cache", log, queue)) for _ in range(2)
    ]
    for worker in workers:
        worker.start()
    results = [queue.get(timeout=120) for _ in workers]
    for worker in workers:
        worker.join(timeout=60)
        assert worker.exitcode == 0
    assert log.read_text().count("build") == 1, "the second process must wait for the first and reuse its entry"
    assert results[0] == results[1]


def test_token_dtype_fits_every_id():
    assert token_dtype(300) == np.uint16
    assert token_dtype(65_536) == np.uint16  # ids 0 .. 65,535
    assert token_dtype(65_537) == np.uint32
