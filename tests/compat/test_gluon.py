"""Each adapter of lm_systems.compat.gluon against the installed Triton: a failure names the internal a new Triton
release changed, so the adapter (and only it) is what to change. Compiles for sm_90 on the CPU (no GPU needed), in a
fresh process: the CPU suite runs Triton's interpreter, which leaves its arithmetic patched into Triton's tensors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

if sys.platform != "linux":
    pytest.skip("triton is installed on Linux only", allow_module_level=True)

import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, tma  # noqa: E402

from lm_systems.compat.gluon import sm90_ptx, tma_reduce_add  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@gluon.jit
def _add_ones_to_rows(X, n_rows, stride, ROWS: gl.constexpr, COLS: gl.constexpr):
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    desc = tma.make_tensor_descriptor(X, [n_rows, COLS], [stride, 1], [ROWS, COLS], layout)
    tile = gl.allocate_shared_memory(gl.float32, [ROWS, COLS], layout)
    tile.store(gl.full([ROWS, COLS], 1.0, gl.float32, gl.BlockedLayout([1, 4], [1, 32], [1, 1], [1, 0])))
    fence_async_shared()
    tma_reduce_add(desc, [gl.program_id(0) * ROWS, 0], tile)
    tma.store_wait(0)


def sm90_reductions() -> list[str]:
    """The bulk-tensor reduction instructions of ``_add_ones_to_rows``'s sm_90 PTX (64 × 128 fp32, one warp)."""
    triton.knobs.compilation.always_compile = True  # the cache does not key on builtins
    signature = {"X": "*fp32", "n_rows": "i32", "stride": "i32", "ROWS": "constexpr", "COLS": "constexpr"}
    ptx = sm90_ptx(
        _add_ones_to_rows, signature, {"ROWS": 64, "COLS": 128},
        {(0,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]}, num_warps=1,
    )  # fmt: skip
    return [line.split()[1] for line in ptx.splitlines() if "cp.reduce.async.bulk.tensor" in line]


def test_tma_reduce_add_emits_hopper_bulk_tensor_reduction_of_every_column():
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [sys.executable, __file__], cwd=REPO, env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert run.returncode == 0, run.stderr[-3000:]
    # 128 fp32 columns are four boxes of 32 (128-byte swizzle): one reduction each, all of them additions.
    assert run.stdout.split() == ["cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.bulk_group"] * 4, (
        f"triton {triton.__version__} changed GluonOpBuilder.create_async_tma_reduce or DESCRIPTOR_REDUCE_KIND: "
        f"update lm_systems/compat/gluon.py (PTX: {run.stdout})"
    )


if __name__ == "__main__":
    print("\n".join(sm90_reductions()))
