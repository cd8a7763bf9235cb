"""The Gluon backward's shipped PTX (``hopper.ptx``): written from the kernel's present sources, by the Triton the
manifest names (the same bytes again where that Triton is installed), and taken where the installed Triton is older
than the one whose code it is. No GPU needed: Triton compiles for sm_90 on the CPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if sys.platform != "linux":  # triton is a dependency on Linux only; there a broken install must fail
    pytest.skip("triton is installed on Linux only", allow_module_level=True)

import triton  # noqa: E402

from lm_systems.attention.hopper import ptx  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
WRITE = "python -m lm_systems.attention.hopper.ptx"


def test_the_shipped_ptx_was_written_from_the_kernel_s_present_sources():
    manifest = json.loads(ptx.MANIFEST.read_text())
    assert manifest["sources_sha256"] == ptx.sources_digest(), (
        f"the Hopper backward's sources ({', '.join(ptx.SOURCES)}) changed since its PTX was written: run {WRITE} "
        f"with Triton >= 3.9"
    )


@pytest.mark.slow
def test_the_named_triton_writes_the_shipped_ptx_again_byte_for_byte():
    written_by = json.loads(ptx.MANIFEST.read_text())["triton"]
    if triton.__version__ != written_by:
        pytest.skip(f"the PTX was written by Triton {written_by}; this is {triton.__version__}")
    code = "from lm_systems.attention.hopper.ptx import backward_ptx; print(backward_ptx('bf16', True, 64), end='')"
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(REPO)}  # a fresh process: no interpreter patches
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout == (ptx.COMPILED / ptx.ptx_name("bf16", True, 64)).read_text(), f"run {WRITE}"


@pytest.mark.parametrize("dtype, is_causal, head_dim", [(torch.bfloat16, True, 128), (torch.float16, False, 64)])
def test_a_triton_older_than_3_9_assembles_the_shipped_ptx_of_the_call_s_dtype_mask_and_head_dim(
    dtype, is_causal, head_dim, monkeypatch
):
    monkeypatch.setattr(ptx, "_triton_version", lambda: (3, 6))
    path = Path(ptx.backward_launch_options(dtype, is_causal, head_dim)["ir_override"])
    mask = "causal" if is_causal else "full"
    name = f"backward_d{head_dim}_{'bf16' if dtype == torch.bfloat16 else 'fp16'}_{mask}.ptx"
    assert path == ptx.COMPILED / name and path.is_file()
    text = path.read_text()
    assert ".visible .entry gluon_backward_kernel(" in text and f".version {ptx.TARGET_PTX_VERSION}" in text
    assert ".loc" not in text and ".file" not in text  # no line table naming the writer's paths


def test_triton_3_9_and_later_compile_the_kernel_themselves_with_the_ptx_s_config(monkeypatch):
    monkeypatch.setattr(ptx, "_triton_version", lambda: (3, 9))
    options = ptx.backward_launch_options(torch.bfloat16, True, 128)
    assert options == {**ptx.BACKWARD_CONFIG, "BLOCK_M": 64, "HEAD_DIM": 128, "CAUSAL": True}
    monkeypatch.setattr(ptx, "_triton_version", lambda: (3, 6))
    older = ptx.backward_launch_options(torch.float16, False, 64)
    assert older.pop("ir_override") and older == {
        **ptx.BACKWARD_CONFIG,
        "BLOCK_M": 128,
        "HEAD_DIM": 64,
        "CAUSAL": False,
    }


def test_every_shipped_file_is_one_the_launches_name():
    named = {ptx.ptx_name(d, c, h) for d in ("bf16", "fp16") for c in (True, False) for h in ptx.HEAD_DIMS}
    assert {path.name for path in ptx.COMPILED.glob("*.ptx")} == named


def test_the_command_refuses_a_triton_older_than_3_9(monkeypatch):
    monkeypatch.setattr(ptx, "_triton_version", lambda: (3, 6))
    monkeypatch.setattr(sys, "argv", ["ptx"])
    with pytest.raises(SystemExit, match="Triton 3.9 or later"):
        ptx.main()
