"""Generation from a training checkpoint: LitLM.load_from_checkpoint rebuilds the trained model; unreadable files
name --ckpt."""

import os
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
import torch.distributed as dist
from environment import environment_kept

from lm_systems.data.datamodule import LMDataModule
from lm_systems.files.checkpoint_dir import CheckpointDirWriter
from lm_systems.files.checkpoint_io import SafeCheckpointIO
from lm_systems.generate import load_checkpoint, main, newest_run_checkpoint
from lm_systems.lit_module import LitLM
from lm_systems.training.sampling import sample_text

SMALL_MODEL = dict(size="tiny", d_model=32, num_layers=2, num_heads=2, d_ff=64, context_length=16, sample_prompt="")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[LitLM, LMDataModule, Path]:
    """A LitLM trained 3 steps on the embedded corpus (vocabulary taken from its tokenizer) and its checkpoint."""
    root = tmp_path_factory.mktemp("trained")
    with environment_kept():
        L.seed_everything(0)
        lit = LitLM(**SMALL_MODEL, warmup_steps=1)
        data = LMDataModule(
            cache_dir=str(root / "data"), generated_stories=300, vocab_size=300, context_length=16, batch_size=2
        )
        trainer = L.Trainer(
            accelerator="cpu",
            max_steps=3,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            plugins=[SafeCheckpointIO()],
        )
        trainer.fit(lit, datamodule=data)
    path = root / "trained.ckpt"
    trainer.save_checkpoint(path)
    return lit, data, path


def test_the_loaded_model_is_the_trained_one(trained, greedy_text):
    lit, data, path = trained
    model, tokenizer = load_checkpoint(path)
    assert model.config == lit.config and model.config.vocab_size == data.vocab_size  # the vocabulary setup resolved
    tokens = torch.randint(0, data.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    lit.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), lit.model(tokens), rtol=0, atol=0)
    assert tokenizer.to_str() == data.tokenizer.to_str()
    expected = greedy_text(lit.model, data.tokenizer, "Once upon a time", max_new_tokens=4)
    assert sample_text(model, tokenizer, "Once upon a time", max_new_tokens=4, temperature=0) == expected


def test_a_checkpoint_directory_is_read_directly(trained, tmp_path, single_rank_group):
    """As zero3, zero1 and fsdp2 write them: the weights gathered from the directory, the same model."""
    lit, data, path = trained
    directory = tmp_path / "trained.ckpt"
    writer = CheckpointDirWriter(dist.new_group(backend="gloo"), asynchronous=False)
    writer.save(torch.load(path, weights_only=False), directory)
    model, tokenizer = load_checkpoint(directory)
    tokens = torch.randint(0, data.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    lit.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), lit.model(tokens), rtol=0, atol=0)
    assert tokenizer.to_str() == data.tokenizer.to_str()


@pytest.mark.gpu
def test_the_model_is_loaded_onto_the_chosen_device(trained):
    lit, data, path = trained
    model, _ = load_checkpoint(path, device="cuda")
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    tokens = torch.randint(0, data.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        # fp32 on both devices; the tolerance covers different matmul kernels (TF32 stays off by default).
        torch.testing.assert_close(model(tokens.cuda()).cpu(), lit.model.cpu()(tokens), rtol=1e-4, atol=1e-4)


def test_the_command_line_samples_from_the_checkpoint(trained, capsys, greedy_text):
    lit, data, path = trained
    main(
        [
            "--ckpt",
            str(path),
            "--prompt",
            "Once upon a time",
            "--max_new_tokens",
            "3",
            "--num_samples",
            "2",
            "--temperature",
            "0",
            "--device",
            "cpu",
        ]
    )
    expected = greedy_text(lit.model, data.tokenizer, "Once upon a time", max_new_tokens=3)
    assert capsys.readouterr().out == f"--- sample 1 ---\n{expected}\n--- sample 2 ---\n{expected}\n"


def test_unreadable_or_foreign_checkpoints_name_the_flag(tmp_path):
    with pytest.raises(FileNotFoundError, match="--ckpt"):
        load_checkpoint(tmp_path / "missing.ckpt")
    with pytest.raises(IsADirectoryError, match="--ckpt"):
        load_checkpoint(tmp_path)
    junk = tmp_path / "junk.ckpt"
    junk.write_text("not a checkpoint")
    with pytest.raises(ValueError, match="--ckpt"):
        load_checkpoint(junk)
    unreadable = tmp_path / "unreadable.ckpt"
    torch.save({}, unreadable)
    unreadable.chmod(0)
    with (
        pytest.MonkeyPatch.context() as patch
    ):  # root (CI's user) reads any file: its access check answers as for others
        patch.setattr(os, "access", lambda path, mode: os.stat(path).st_mode & 0o444 != 0)
        with pytest.raises(PermissionError, match="--ckpt .* cannot be read \\(permission denied\\)"):
            load_checkpoint(unreadable)
    foreign = tmp_path / "foreign.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(2)}}, foreign)
    with pytest.raises(ValueError, match="not written by lm_systems training"):
        load_checkpoint(foreign)


def test_the_command_line_reports_a_bad_checkpoint_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--ckpt", str(tmp_path / "missing.ckpt")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--ckpt" in err and "does not exist" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "args, says",
    [
        (["--max_new_tokens", "0"], "argument --max_new_tokens: must be >= 1, got 0"),
        (["--max_new_tokens", "-1"], "argument --max_new_tokens: must be >= 1, got -1"),
        (["--num_samples", "0"], "argument --num_samples: must be >= 1, got 0"),
        (["--temperature", "-1"], "argument --temperature: must be >= 0, got -1"),
        (["--top_p", "0"], "argument --top_p: must be in (0, 1], got 0"),
        (["--top_p", "1.5"], "argument --top_p: must be in (0, 1], got 1.5"),
        (["--prompt", ""], "--prompt is empty: give some text to continue"),
        (["--device", "gpu7"], "--device 'gpu7' is not a device (cpu, cuda, cuda:1, ...)"),
        pytest.param(
            ["--device", "cuda"],
            "--device 'cuda': no CUDA device is available here; pass --device cpu",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA"),
        ),
    ],
)
def test_bad_arguments_are_one_line_usage_errors(trained, capsys, args, says):
    _, _, path = trained
    with pytest.raises(SystemExit) as exit_:
        main(["--ckpt", str(path), *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].endswith(f"error: {says}"), err


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert exit_.value.code == 0
    for default in ("(default: 100)", "(default: 0.8)", "(default: 0.9)", "(default: Once upon a time)"):
        assert default in out, out


def test_last_takes_the_newest_runs_checkpoint(trained, tmp_path, monkeypatch, capsys):
    """``--ckpt last`` after several runs samples the newest, not version_0 (the README's line hard-coded it)."""
    _, _, path = trained
    runs = tmp_path / "logs" / "lm_systems"
    for version, mtime in ((0, 2_000_000_000), (1, 1_000_000_000), (2, 1_500_000_000)):  # version_0 resumed last
        folder = runs / f"version_{version}" / "checkpoints"
        folder.mkdir(parents=True)
        (folder / "step=3.ckpt").write_bytes(path.read_bytes())
        os.utime(folder / "step=3.ckpt", (mtime, mtime))
        (folder / "last.ckpt").symlink_to("step=3.ckpt")
    (runs / "version_3" / "checkpoints").mkdir(parents=True)
    (runs / "version_3" / "checkpoints" / "last.ckpt").symlink_to("gone.ckpt")  # a dangling link is skipped
    monkeypatch.chdir(tmp_path)
    assert newest_run_checkpoint() == Path("logs/lm_systems/version_0/checkpoints/last.ckpt")
    main(["--ckpt", "last", "--max_new_tokens", "2", "--device", "cpu"])
    captured = capsys.readouterr()
    assert "checkpoint: logs/lm_systems/version_0/checkpoints/last.ckpt" in captured.err
    assert "--- sample 1 ---" in captured.out


def test_last_without_runs_names_the_flag(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["--ckpt", "last"])
    assert exit_.value.code == 2
    assert "--ckpt last: no run checkpoint" in capsys.readouterr().err
