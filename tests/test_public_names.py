"""The names a user reaches for import from their packages, and the model imports without Lightning."""

import importlib
import os
import subprocess
import sys

import pytest

PUBLIC = {  # package: {name: the module that defines it}
    "lm_systems": {
        "TransformerLM": "lm_systems.model.transformer",
        "ModelConfig": "lm_systems.model.config",
        "LitLM": "lm_systems.lit_module",
    },
    "lm_systems.attention": {
        "FlashAttention2Torch": "lm_systems.attention.flash_torch",
        "FlashAttention2Triton": "lm_systems.attention.flash_triton",
    },
    "lm_systems.data": {"LMDataModule": "lm_systems.data.datamodule"},
}


@pytest.mark.parametrize("package", PUBLIC)
def test_public_names_are_the_classes(package):
    """Each name a user imports from a package is the class of that name defined in its own module (not a copy, a
    wrapper or another class of the same name), and the packages that list their names list these."""
    exported = importlib.import_module(package)
    for name, module in PUBLIC[package].items():
        value = getattr(exported, name)
        assert (value.__module__, value.__qualname__) == (module, name)
        assert value is vars(importlib.import_module(module))[name]
    if hasattr(exported, "__all__"):
        assert set(PUBLIC[package]) <= set(exported.__all__)


@pytest.mark.slow
def test_the_model_and_the_tokenizer_import_without_lightning():
    code = (
        "import sys\n"
        "from lm_systems import ModelConfig, TransformerLM\n"
        "from lm_systems.data.tokenizer import load_tokenizer\n"
        "TransformerLM(ModelConfig.from_name('tiny'))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    ).stdout
    assert out.strip() == "[]"
