"""LMDataModule end to end: lazy vocabulary, batches, ranks from the trainer, resume position, errors."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lm_systems.data.datamodule import LMDataModule
from lm_systems.data.generated_corpus import generate_stories
from lm_systems.data.tokenizer import END_OF_TEXT


def generated(tmp_path, **kwargs) -> LMDataModule:
    settings = dict(
        generated_stories=150, vocab_size=400, context_length=31, batch_size=5, cache_dir=str(tmp_path / "cache")
    )
    return LMDataModule(**{**settings, **kwargs})


def test_vocabulary_is_known_right_after_construction(tmp_path):
    module = generated(tmp_path)
    assert module.vocab_size == module.tokenizer.get_vocab_size() <= 400
    assert module.tokenizer.id_to_token(module.eot_id) == END_OF_TEXT
    tokens = module.token_splits
    assert tokens.tokens("train").max() < module.vocab_size
    assert int((tokens.tokens("train") == module.eot_id).sum()) > 100, "stories are separated by <|endoftext|>"


def test_train_windows_decode_to_pieces_of_the_generated_stories(tmp_path):
    module = generated(tmp_path, seed=77)
    module.setup("fit")
    corpus_text = "".join(f"{story}\n{END_OF_TEXT}" for story in generate_stories(150, seed=77))
    for batch in itertools.islice(iter(module.train_dataloader()), 3):
        assert batch.shape == (5, 32) and batch.dtype == torch.long
        for row in batch.tolist():
            assert module.tokenizer.decode(row, skip_special_tokens=False) in corpus_text


def test_ranks_come_from_the_attached_trainer(tmp_path):
    batches = []
    for rank in (0, 1):
        module = generated(tmp_path)
        module.trainer = SimpleNamespace(global_rank=rank, world_size=2)
        module.setup("fit")
        batches.append(list(itertools.islice(iter(module.train_dataloader()), 3)))
    assert all(not torch.equal(a, b) for a, b in zip(*batches, strict=True))
    alone = list(itertools.islice(iter(generated(tmp_path).train_dataloader()), 3))
    assert not torch.equal(alone[0], batches[0][0]), "world size 1 and 2 draw different streams"


def test_validation_set_is_the_same_for_any_number_of_ranks(tmp_path):
    def rows(world_size: int) -> list[list[int]]:
        result = []
        for rank in range(world_size):
            module = generated(tmp_path, val_batches=6)
            module.trainer = SimpleNamespace(global_rank=rank, world_size=world_size)
            batches = list(module.val_dataloader())
            assert len(batches) == 6 // world_size
            result += [row for batch in batches for row in batch.tolist()]
        return sorted(result)

    single = rows(1)
    assert len(single) == 30
    assert rows(2) == single and rows(3) == single


class BatchRecorder(L.LightningModule):
    """Trains nothing; keeps every training batch it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.seen.append(batch.clone())
        return self.weight * batch.float().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(tmp_path, datamodule, max_steps, accumulate, ckpt_path=None, callbacks=()):
    model = BatchRecorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=bool(callbacks),
        callbacks=list(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    return model.seen


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
@pytest.mark.parametrize("num_workers, accumulate", [(0, 1), (2, 2)])
def test_resume_continues_the_stream_where_the_checkpoint_left_it(tmp_path, num_workers, accumulate):
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    full = fit(tmp_path, generated(tmp_path, num_workers=num_workers), 7, accumulate, callbacks=[checkpoint])
    assert len(full) == 7 * accumulate
    step3 = next((tmp_path / "ckpt").glob("*step=3.ckpt"))
    assert torch.load(step3, weights_only=False)["LMDataModule"] == {"train_batches_consumed": 3 * accumulate}

    resumed = fit(tmp_path, generated(tmp_path, num_workers=num_workers), 7, accumulate, ckpt_path=step3)
    assert len(resumed) == 4 * accumulate
    for a, b in zip(full[3 * accumulate :], resumed, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_context_longer_than_the_validation_split_names_the_flags(tmp_path):
    module = generated(tmp_path, context_length=2000)
    with pytest.raises(
        ValueError, match="validation split .* too few .* --data.context_length 2000.*--data.val_fraction"
    ):
        module.setup("fit")


def test_train_split_shorter_than_a_window_names_the_flag(tmp_path):
    path = tmp_path / "short.jsonl"
    path.write_text('{"text": "one two three four five six seven eight nine ten"}\n' * 3)
    module = LMDataModule(
        corpus=str(path), vocab_size=260, context_length=500, val_fraction=0.5, cache_dir=str(tmp_path / "cache")
    )
    with pytest.raises(ValueError, match="train split .* fewer than one window of --data.context_length 500"):
        module.setup("fit")


def test_too_few_validation_windows_for_the_ranks_names_the_flag(tmp_path):
    module = generated(tmp_path, val_batches=1, batch_size=1)
    module.trainer = SimpleNamespace(global_rank=0, world_size=2)
    with pytest.raises(ValueError, match="raise --data.val_batches"):
        module.setup("fit")


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"val_fraction": 0.0}, "--data.val_fraction"),
        ({"val_fraction": 1.0}, "--data.val_fraction"),
        ({"context_length": 0}, "--data.context_length"),
        ({"batch_size": -1}, "--data.batch_size"),
        ({"num_workers": -1}, "--data.num_workers"),
        ({"corpus": "nowhere/corpus.txt"}, "--data.corpus"),
        ({"corpus": ""}, "--data.corpus"),
    ],
)
def test_bad_settings_name_the_flag(tmp_path, kwargs, flag):
    with pytest.raises((ValueError, FileNotFoundError), match=flag):
        generated(tmp_path, **kwargs)


def test_unreadable_tokenizer_names_the_flag(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_bytes(b"\x00\x01 not json")
    module = generated(tmp_path, tokenizer=str(path))
    with pytest.raises(ValueError, match="--data.tokenizer"):
        module.prepare_data()


class RankRecorder(BatchRecorder):
    """Saves the batches each rank trained and validated on, for the test process to compare."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir
        self.val_seen: list[torch.Tensor] = []

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.val_seen.append(batch.clone())

    def on_train_end(self) -> None:
        torch.save({"train": self.seen, "val": self.val_seen}, f"{self.out_dir}/rank{self.global_rank}.pt")


@pytest.mark.slow
def test_two_processes_train_on_different_windows_and_split_validation(tmp_path):
    # Forked where possible: a spawned rank re-imports torch and Lightning (~50 s on two busy cores). Once
    # a GPU test has initialised CUDA in this process Lightning refuses to fork, so GPU sessions spawn.
    start = "ddp_spawn" if torch.cuda.is_initialized() else "ddp_fork"
    module = generated(tmp_path, val_batches=4)
    module.prepare_data()  # once here, so the ranks only read the cache
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=start,
        max_steps=3,
        val_check_interval=3,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(RankRecorder(str(tmp_path)), datamodule=module)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    for a, b in zip(ranks[0]["train"], ranks[1]["train"], strict=True):
        assert a.shape == b.shape == (5, 32) and not torch.equal(a, b)
    # Together the ranks validate on exactly the single-process validation set, in equal shares.
    assert len(ranks[0]["val"]) == len(ranks[1]["val"]) == 2
    together = sorted(row for rank in ranks for batch in rank["val"] for row in batch.tolist())
    alone = sorted(row for batch in generated(tmp_path, val_batches=4).val_dataloader() for row in batch.tolist())
    assert together == alone


def test_a_tokenizer_short_of_the_asked_vocabulary_says_why(tmp_path, lightning_log):
    """The run printed `vocab 1004` after asking for 10000, unexplained."""
    caplog = lightning_log
    module = generated(tmp_path, vocab_size=10_000)
    assert module.vocab_size < 10_000
    said = [record.getMessage() for record in caplog.records]
    assert (
        f"the BPE stopped at {module.vocab_size} tokens: every word that occurs twice in 'generated' is one token "
        "already, so no merge is left to learn" in said
    )
    caplog.clear()
    assert generated(tmp_path / "other", vocab_size=300).vocab_size == 300  # reached: nothing to explain
    assert not [message for message in (r.getMessage() for r in caplog.records) if "stopped" in message]
