"""Corpus sources: each kind of --data.corpus gives the token stream an independent encoding predicts."""

from __future__ import annotations

import math

import numpy as np
import pytest
from datasets import Dataset, DatasetDict

from lm_systems.data.corpus import load_corpus, resolve_corpus
from lm_systems.data.datamodule import LMDataModule
from lm_systems.data.tokenizer import END_OF_TEXT, save_tokenizer


@pytest.fixture
def tokenizer_file(tmp_path, small_tokenizer):
    return save_tokenizer(small_tokenizer, tmp_path / "tokenizer.json")


def prepared(corpus, tokenizer_file, tmp_path, **kwargs) -> LMDataModule:
    module = LMDataModule(
        corpus=str(corpus), tokenizer=str(tokenizer_file), cache_dir=str(tmp_path / "cache"), **kwargs
    )
    module.prepare_data()
    return module


def documents_stream(tokenizer, documents) -> list[int]:
    """The reference: each document encoded on its own, followed by the <|endoftext|> id."""
    eot_id = tokenizer.token_to_id(END_OF_TEXT)
    return [i for doc in documents for i in tokenizer.encode(doc).ids + [eot_id]]


def both_splits(module: LMDataModule) -> list[int]:
    return np.concatenate([module.token_splits.tokens("train"), module.token_splits.tokens("validation")]).tolist()


def test_txt_file_is_one_stream_and_its_tail_is_held_out(txt_corpus, tokenizer_file, small_tokenizer, tmp_path):
    module = prepared(txt_corpus, tokenizer_file, tmp_path, val_fraction=0.13)
    # Lines are tokenised one by one; the whole file encoded at once must give the same ids.
    expected = small_tokenizer.encode(txt_corpus.read_text(encoding="utf-8")).ids
    assert both_splits(module) == expected
    assert len(module.token_splits.tokens("validation")) == math.ceil(len(expected) * 0.13)
    assert module.token_splits.tokens("train").dtype == np.uint16


def test_jsonl_rows_are_documents_in_the_chosen_column(
    jsonl_corpus, tokenizer_file, small_tokenizer, documents, tmp_path
):
    module = prepared(jsonl_corpus, tokenizer_file, tmp_path, text_column="story", val_fraction=0.3)
    assert both_splits(module) == documents_stream(small_tokenizer, documents)


def test_parquet_file(tmp_path, tokenizer_file, small_tokenizer, documents):
    path = tmp_path / "corpus.parquet"
    Dataset.from_dict({"text": documents[:41]}).to_parquet(str(path))
    module = prepared(path, tokenizer_file, tmp_path)
    assert both_splits(module) == documents_stream(small_tokenizer, documents[:41])


def test_saved_dataset_with_its_own_validation_split(tmp_path, tokenizer_file, small_tokenizer, documents):
    folder = tmp_path / "saved"
    DatasetDict(
        train=Dataset.from_dict({"content": documents[:50]}),
        validation=Dataset.from_dict({"content": documents[50:63]}),
    ).save_to_disk(str(folder))
    module = prepared(folder, tokenizer_file, tmp_path, text_column="content")
    assert module.token_splits.tokens("train").tolist() == documents_stream(small_tokenizer, documents[:50])
    assert module.token_splits.tokens("validation").tolist() == documents_stream(small_tokenizer, documents[50:63])


def test_saved_single_dataset(tmp_path, tokenizer_file, small_tokenizer, documents):
    folder = tmp_path / "saved"
    Dataset.from_dict({"text": documents[:29]}).save_to_disk(str(folder))
    module = prepared(folder, tokenizer_file, tmp_path, val_fraction=0.2)
    assert both_splits(module) == documents_stream(small_tokenizer, documents[:29])


def test_a_hub_name_is_recognised_without_touching_the_network(tmp_path):
    source = resolve_corpus("roneneldan/TinyStories", tmp_path, generated_stories=1, seed=0)
    assert source.kind == "hub" and source.identity == {"hub": "roneneldan/TinyStories"}


def test_hub_without_network_says_how_to_get_the_data_in(tmp_path, monkeypatch):
    def offline(*args, **kwargs):  # what datasets raises here after its retries, offline
        raise ConnectionError("Couldn't reach 'roneneldan/TinyStories' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr("datasets.load_dataset", offline)  # corpus.py imports it where it reads
    source = resolve_corpus("roneneldan/TinyStories", tmp_path, generated_stories=1, seed=0)
    with pytest.raises(
        ConnectionError, match=r"--data.corpus 'roneneldan/TinyStories'.*save_to_disk.*--data.corpus some_folder"
    ):
        load_corpus(source, tmp_path, "text")


@pytest.mark.parametrize("spec", ["data/missing.txt", "./missing", "/no/such/dir/corpus.jsonl", "~/missing.parquet"])
def test_missing_path_names_the_flag(tmp_path, spec):
    with pytest.raises(FileNotFoundError, match="--data.corpus .* does not exist"):
        resolve_corpus(spec, tmp_path, generated_stories=1, seed=0)


def test_unsupported_file_and_plain_folder_are_refused(tmp_path):
    (tmp_path / "corpus.csv").write_text("text\nhello\n")
    with pytest.raises(ValueError, match="--data.corpus .* unsupported extension '.csv'"):
        resolve_corpus(str(tmp_path / "corpus.csv"), tmp_path, generated_stories=1, seed=0)
    with pytest.raises(ValueError, match="--data.corpus .* not one written by Dataset.save_to_disk"):
        resolve_corpus(str(tmp_path), tmp_path, generated_stories=1, seed=0)


def test_wrong_text_column_lists_the_columns(jsonl_corpus, tokenizer_file, tmp_path):
    with pytest.raises(ValueError, match=r"--data.text_column 'text' is not a column .*\(its columns: story, id\)"):
        prepared(jsonl_corpus, tokenizer_file, tmp_path)


def test_empty_file_is_an_error(tmp_path, tokenizer_file):
    path = tmp_path / "empty.txt"
    path.write_text("")
    with pytest.raises(ValueError, match="--data.corpus .* is empty"):
        prepared(path, tokenizer_file, tmp_path)


def test_rows_without_text_are_an_error(tmp_path, tokenizer_file):
    path = tmp_path / "blank.jsonl"
    path.write_text('{"text": ""}\n' * 5)
    with pytest.raises(ValueError, match="--data.corpus .* has no text"):
        prepared(path, tokenizer_file, tmp_path)


def test_tokenizing_in_several_processes_keeps_the_order(
    jsonl_corpus, tokenizer_file, small_tokenizer, documents, tmp_path
):
    module = prepared(jsonl_corpus, tokenizer_file, tmp_path, text_column="story", num_proc=2)
    assert both_splits(module) == documents_stream(small_tokenizer, documents)
