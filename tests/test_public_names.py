"""The names a user reaches for import from their packages, and the model imports without Lightning."""

import os
import subprocess
import sys


def test_public_names_are_the_classes():
    from lm_systems import LitLM, ModelConfig, TransformerLM
    from lm_systems.attention import FlashAttention2Torch, FlashAttention2Triton
    from lm_systems.attention.flash_torch import FlashAttention2Torch as torch_kernel
    from lm_systems.attention.flash_triton import FlashAttention2Triton as triton_kernel
    from lm_systems.config import ModelConfig as config
    from lm_systems.data import LMDataModule
    from lm_systems.data.datamodule import LMDataModule as datamodule
    from lm_systems.lit_module import LitLM as lit
    from lm_systems.model import TransformerLM as model

    assert (TransformerLM, ModelConfig, LitLM, LMDataModule) == (model, config, lit, datamodule)
    assert (FlashAttention2Torch, FlashAttention2Triton) == (torch_kernel, triton_kernel)


def test_the_model_and_the_tokenizer_import_without_lightning():
    code = ("import sys\n"
            "from lm_systems import ModelConfig, TransformerLM\n"
            "from lm_systems.data.tokenizer import load_tokenizer\n"
            "TransformerLM(ModelConfig.from_name('tiny'))\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "TRITON_INTERPRET": "1"}).stdout
    assert out.strip() == "[]"
