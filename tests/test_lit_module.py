"""LitLM end to end on the embedded corpus: learning, resuming exactly, checkpoint contents, bad input; its model built
in configure_model from a config every ModelConfig field reaches."""

import math
from dataclasses import fields, replace
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as L
import pytest
import torch
from every_model_option import EVERY_MODEL_OPTION
from random_windows import RandomWindowsLM
from schedule_reference import expected_lr_factor
from torch.utils.data import DataLoader

from lm_systems.data.datamodule import LMDataModule
from lm_systems.files.checkpoint_io import SafeCheckpointIO
from lm_systems.generate import load_checkpoint
from lm_systems.lit_module import LitLM
from lm_systems.model.config import MODEL_SIZES, ModelConfig
from lm_systems.model.transformer import TransformerLM
from lm_systems.run.description import run_hyperparameters
from lm_systems.run_callbacks.checkpoints import CrashCheckpoint, StepCheckpoint
from lm_systems.training.sampling import sample_text

SMALL_MODEL = dict(
    size="tiny", d_model=64, num_layers=2, num_heads=2, d_ff=192, context_length=32, warmup_steps=5, sample_prompt=""
)


def datamodule(cache_dir: Path, **overrides) -> LMDataModule:
    kwargs = dict(
        cache_dir=str(cache_dir), generated_stories=2000, vocab_size=512, context_length=32, batch_size=8, val_batches=4
    )
    return LMDataModule(**{**kwargs, **overrides})


def trainer(tmp_path: Path, max_steps: int, interval: int = 0, **kwargs) -> L.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        val_check_interval=max_steps,
        check_val_every_n_epoch=None,
        gradient_clip_val=1.0,
        callbacks=[StepCheckpoint(interval, dirpath=str(tmp_path / "ckpt")), CrashCheckpoint()],
        plugins=[SafeCheckpointIO()],
    )
    return L.Trainer(**{**defaults, **kwargs})


def test_loss_is_the_cross_entropy_of_each_token_against_the_next():
    """Weights under which the model predicts "this token + 1" with logit margin 3 (the blocks add nothing
    to the residual stream, the embedding is one-hot, the head points at the successor). On a batch where
    that guess is right at 5 of 8 positions, the loss is the hand-computed mean; targets that are not the
    next token (unshifted, or shifted the wrong way) give another value."""
    vocab, width = 5, 8
    lit = LitLM(size="tiny", vocab_size=vocab, context_length=8, d_model=width, num_layers=1, num_heads=2, d_ff=16)
    lit.configure_model()
    model = lit.model
    with torch.no_grad():
        for block in model.blocks:
            block.attn.out.weight.zero_()
            block.ffn.w2.weight.zero_()
        model.embedding.weight.copy_(math.sqrt(width) * torch.eye(vocab, width))  # RMS 1: the final norm keeps it
        model.final_norm.weight.fill_(1.0)
        head = torch.eye(vocab, width).roll(1, dims=0) * 3.0 / math.sqrt(width)  # row v reads token v - 1
        model.lm_head.weight.copy_(head)
    batch = torch.tensor(
        [
            [0, 1, 2, 3, 0],  # 0→1, 1→2, 2→3 right; 3→0 wrong (guess 4)
            [2, 2, 4, 0, 1],  # 2→2, 2→4 wrong (guess 3); 4→0, 0→1 right
        ]
    )
    right = math.log(1 + (vocab - 1) * math.exp(-3))  # −log(e³ / (e³ + 4))
    wrong = math.log(math.exp(3) + vocab - 1)  # −log(1 / (e³ + 4))
    # rel 1e-4: the norms' eps (1e-5) scales the margin by 1/sqrt(1 + 1e-5), about 5e-6 of the loss.
    assert lit._loss(batch).item() == pytest.approx((5 * right + 3 * wrong) / 8, rel=1e-4)


@pytest.mark.slow
def test_training_on_the_embedded_corpus_lowers_validation_loss(cache_dir, tmp_path):
    L.seed_everything(0)
    model, data = LitLM(**SMALL_MODEL, lr=1e-2), datamodule(cache_dir)
    t = trainer(tmp_path, max_steps=80, num_sanity_val_steps=0)
    before = t.validate(model, datamodule=data, verbose=False)[0]["val/loss"]
    t.fit(model, datamodule=data)
    after = t.callback_metrics["val/loss"].item()
    assert after < 0.8 * before, (before, after)
    assert model.hparams.vocab_size == data.vocab_size  # resolved from the tokenizer and recorded
    assert model.config.vocab_size == model.model.config.vocab_size == data.vocab_size


@pytest.mark.slow
def test_resume_continues_at_the_same_step_learning_rate_and_data_position(
    cache_dir, tmp_path, assert_same_training_state
):
    """Validating every 4 steps, stopped at 6 and resumed: step 12's checkpoint and validation loss are the
    uninterrupted run's, bit for bit."""

    def run(steps: int, ckpt_path=None, interval=0):
        L.seed_everything(0)
        model, data = LitLM(**SMALL_MODEL), datamodule(cache_dir)
        t = trainer(tmp_path, max_steps=steps, interval=interval, num_sanity_val_steps=0, val_check_interval=4)
        t.fit(model, datamodule=data, ckpt_path=ckpt_path)
        return t, torch.load(tmp_path / "ckpt" / f"step={steps}.ckpt", weights_only=False)

    full_trainer, full = run(12, interval=6)
    halfway = tmp_path / "ckpt" / "step=6.ckpt"
    assert halfway.is_file()
    resumed_trainer, resumed = run(12, ckpt_path=str(halfway))
    assert resumed["global_step"] == 12 and resumed["LMDataModule"] == {"train_batches_consumed": 12}
    assert_same_training_state(resumed, full)
    assert resumed_trainer.callback_metrics["val/loss"] == full_trainer.callback_metrics["val/loss"]


@pytest.mark.slow
def test_checkpoints_carry_the_model_config_and_tokenizer_for_generation(cache_dir, tmp_path, greedy_text):
    data = datamodule(cache_dir)
    t = trainer(tmp_path, max_steps=2, limit_val_batches=0)
    trained = LitLM(**SMALL_MODEL)
    t.fit(trained, datamodule=data)
    model, tokenizer = load_checkpoint(tmp_path / "ckpt" / "last.ckpt")
    assert model.config.vocab_size == data.vocab_size and model.config.d_model == 64
    assert tokenizer.to_str() == data.tokenizer.to_str()
    # Greedy text from the checkpoint's model: the trained model's own argmax continuation.
    expected = greedy_text(trained.model, data.tokenizer, "Once upon a time", max_new_tokens=5)
    assert sample_text(model, tokenizer, "Once upon a time", max_new_tokens=5, temperature=0) == expected
    restored = LitLM.load_from_checkpoint(tmp_path / "ckpt" / "last.ckpt")
    assert restored.model.config == model.config
    for (name, weight), restored_weight in zip(
        trained.model.state_dict().items(), restored.model.state_dict().values(), strict=True
    ):
        assert torch.equal(restored_weight, weight), name


def test_model_vocab_smaller_than_the_tokenizer_names_the_flag(cache_dir, tmp_path):
    with pytest.raises(ValueError, match="--model.vocab_size"):
        trainer(tmp_path, max_steps=1).fit(
            LitLM(**{**SMALL_MODEL, "vocab_size": 100}), datamodule=datamodule(cache_dir)
        )


def test_data_windows_longer_than_the_model_context_name_the_flag(cache_dir, tmp_path):
    with pytest.raises(ValueError, match="--model.context_length"):
        trainer(tmp_path, max_steps=1).fit(LitLM(**SMALL_MODEL), datamodule=datamodule(cache_dir, context_length=64))


def test_without_a_vocabulary_or_a_tokenizer_to_take_it_from_setup_names_the_flag(tmp_path):
    windows = torch.randint(0, 50, (4, 33), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="model.vocab_size is unset and the datamodule has no tokenizer"):
        trainer(tmp_path, max_steps=1).fit(LitLM(**SMALL_MODEL), train_dataloaders=DataLoader(windows, batch_size=2))


def test_training_without_a_step_count_names_the_flag(cache_dir, tmp_path):
    """The cosine schedule decays over max_steps (or model.decay_steps): an epoch-bounded run has neither."""
    with pytest.raises(ValueError, match="the cosine schedule needs a length: set --max_steps"):
        trainer(tmp_path, max_steps=-1, max_epochs=1, val_check_interval=1.0, check_val_every_n_epoch=1).fit(
            LitLM(**SMALL_MODEL), datamodule=datamodule(cache_dir)
        )


def test_clipping_by_value_names_the_flag(cache_dir, tmp_path):
    with pytest.raises(
        ValueError, match="only clipping by norm is supported, got --trainer.gradient_clip_algorithm value"
    ):
        trainer(tmp_path, max_steps=1, limit_val_batches=0, gradient_clip_algorithm="value").fit(
            LitLM(**SMALL_MODEL), datamodule=datamodule(cache_dir)
        )


@pytest.mark.parametrize(
    "kwargs, key",
    [({"size": "huge"}, "--model.size"), ({"attention": "flash9"}, "--model.attention"), ({"lr": 0}, "model.lr")],
)
def test_bad_model_arguments_fail_at_construction(kwargs, key):
    with pytest.raises(ValueError, match=key):
        LitLM(**{**SMALL_MODEL, **kwargs})


def _record_compiles(monkeypatch) -> list[tuple[str, torch.nn.Module]]:
    calls = []
    monkeypatch.setattr(TransformerLM, "compile_blocks", lambda self, *a, **k: calls.append(("blocks", self)))
    monkeypatch.setattr(TransformerLM, "compile", lambda self, *a, **k: calls.append(("whole", self)))
    return calls


def test_compile_happens_once_across_stages(cache_dir, tmp_path, monkeypatch):
    calls = _record_compiles(monkeypatch)
    model, data = LitLM(**SMALL_MODEL, compile=True), datamodule(cache_dir)
    t = trainer(tmp_path, max_steps=1, limit_val_batches=1, num_sanity_val_steps=0)
    t.fit(model, datamodule=data)
    t.validate(model, datamodule=data, verbose=False)
    assert calls == [("whole", model.model)]


@pytest.mark.parametrize(
    "devices, strategy, compile, compiled",
    [
        (1, "auto", True, "whole"),
        (2, "ddp_spawn", True, "blocks"),
        (1, "zero3", True, "blocks"),
        (1, "auto", "blocks", "blocks"),
        (2, "ddp_spawn", "model", "whole"),
    ],
)
def test_compile_is_per_block_under_a_data_parallel_strategy_unless_named(
    devices, strategy, compile, compiled, monkeypatch
):
    """A data-parallel strategy overlaps each block's gradient communication with backward, which needs each
    block's backward to be a node of its own, and zero3 gathers a block's parameters in hooks that a graph must not
    trace, on one process too; under a single-device strategy the whole model compiles into one graph. A named
    choice holds everywhere."""
    import strategies  # noqa: F401  (registers zero3)

    calls = _record_compiles(monkeypatch)
    lit = LitLM(**SMALL_MODEL, vocab_size=100, compile=compile)
    lit.trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    lit.configure_model()
    assert calls == [(compiled, lit.model)]


@pytest.mark.parametrize("bucket_size_mb, runs", [(math.inf, [2]), (1e-6, [1, 1])])
def test_compile_buckets_compiles_the_runs_of_blocks_that_share_a_bucket(bucket_size_mb, runs, monkeypatch):
    from strategies import BucketedDDPStrategy

    calls = []
    monkeypatch.setattr(TransformerLM, "compile_blocks", lambda self, runs=None, **k: calls.append(runs))
    lit = LitLM(**SMALL_MODEL, vocab_size=100, compile="buckets")
    lit.trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        logger=False,
        enable_progress_bar=False,
        strategy=BucketedDDPStrategy(bucket_size_mb=bucket_size_mb, start_method="spawn"),
    )
    lit.configure_model()
    assert calls == [runs]  # one bucket: both blocks in one graph; a bucket a parameter: a graph a block


def test_compile_buckets_without_a_bucketing_strategy_says_what_to_use():
    lit = LitLM(**SMALL_MODEL, vocab_size=100, compile="buckets")
    lit.trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    offered = "bucketed_ddp or bucketed_ddp_spawn or zero1 or zero1_spawn"  # registered, offering BlockRuns
    said = rf"--model.compile buckets .*\(--strategy {offered}\), got SingleDeviceStrategy"
    with pytest.raises(ValueError, match=said):
        lit.configure_model()


def test_the_model_is_built_by_configure_model_once():
    lit = LitLM(**SMALL_MODEL, vocab_size=100)
    assert lit.model is None
    lit.configure_model()
    built = lit.model
    assert isinstance(built, TransformerLM) and built.config == lit.config
    lit.configure_model()  # Lightning calls it at every fit, validate, … and load_from_checkpoint
    assert lit.model is built


def test_the_trainer_builds_the_model_after_setup_inside_the_strategys_init_context(cache_dir, tmp_path, monkeypatch):
    """Under 64-true, Lightning's tensor_init_context makes float64 the default dtype: a model built there (and not in
    __init__ or setup) is created in float64; its vocabulary is the tokenizer's, which setup resolved first."""
    built_under = []
    build = TransformerLM.__init__

    def recording_build(self, config, *block_recompute):
        built_under.append((torch.get_default_dtype(), config.vocab_size))
        build(self, config, *block_recompute)

    monkeypatch.setattr(TransformerLM, "__init__", recording_build)
    data = datamodule(cache_dir)
    lit = LitLM(**SMALL_MODEL)
    assert built_under == []
    trainer(tmp_path, max_steps=1, limit_val_batches=0, precision="64-true").fit(lit, datamodule=data)
    assert built_under == [(torch.float64, data.vocab_size)]


def test_outside_a_trainer_an_unknown_vocabulary_names_the_flag():
    lit = LitLM(**SMALL_MODEL)
    for use in (lambda: lit.config, lit.configure_model):
        with pytest.raises(RuntimeError, match="--model.vocab_size"):
            use()


def test_every_model_config_field_is_a_litlm_argument_with_the_same_meaning():
    """So each one is settable from the command line (--model.<field>) and reaches the model: a value for every
    field, none of them tiny's, makes exactly that ModelConfig; unset ones keep the named size's."""
    values = EVERY_MODEL_OPTION
    assert set(values) == {f.name for f in fields(ModelConfig)}, "give the new ModelConfig field a value here"
    tiny = MODEL_SIZES["tiny"]
    assert all(getattr(tiny, name) != value for name, value in values.items())
    lit = LitLM(**values)
    assert lit.config == ModelConfig(**values)
    lit.configure_model()
    assert lit.model.config == lit.config
    assert LitLM(size="xl", vocab_size=100, d_model=2000).config == replace(
        MODEL_SIZES["xl"], vocab_size=100, d_model=2000
    )
    with pytest.raises(AttributeError):
        lit.config = tiny  # read-only


@pytest.mark.parametrize(
    "devices, accumulate, batch_size, context", [(1, 1, 2, 16), (2, 1, 4, 32), (1, 4, 3, 8), (3, 2, 5, 12)]
)
def test_tokens_per_step_counts_every_device_and_micro_batch(devices, accumulate, batch_size, context):
    """The hyperparameter TensorBoard shows: each optimizer step trains on batch × context tokens per micro-batch,
    ``accumulate`` micro-batches per device, on every device."""
    lit = LitLM(size="tiny", vocab_size=64, d_model=16, num_layers=1, num_heads=2, d_ff=32)
    lit.trainer = SimpleNamespace(
        world_size=devices, accumulate_grad_batches=accumulate, max_steps=10, precision="32-true", strategy=object()
    )
    hyperparameters = run_hyperparameters(lit.hparams, lit.config, lit.trainer, (batch_size, context), None)
    assert hyperparameters["tokens_per_step"] == devices * accumulate * batch_size * context


class StepRates(L.Callback):
    """The learning rate each optimizer step trains with (read just before the step)."""

    def __init__(self) -> None:
        self.rates: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.rates.append(optimizer.param_groups[0]["lr"])


@pytest.mark.parametrize("accumulate", [1, 3])
def test_each_optimizer_step_trains_at_the_schedules_rate(tmp_path, accumulate):
    """Warm-up and cosine move once per optimizer step (not per epoch, nor per micro-batch), against the formula
    written apart from the product (tests/schedule_reference.py), past the decay into the floor."""
    rates = StepRates()
    lit = RandomWindowsLM(lr=0.02, warmup_steps=3, decay_steps=9, min_lr_ratio=0.25)
    L.Trainer(
        accelerator="cpu",
        max_steps=12,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accumulate_grad_batches=accumulate,
        callbacks=[rates],
    ).fit(lit)
    expected = [0.02 * expected_lr_factor(step, warmup=3, decay=9, floor=0.25) for step in range(12)]
    assert rates.rates == pytest.approx(expected, rel=1e-12)
