"""The Gluon backward's PTX as Triton 3.9 writes it, shipped for the Tritons before it, and the command that writes it.

Triton 3.6 compiles ``backward.gluon_backward_kernel`` with over 800 bytes a thread spilled; Triton 3.9 with under
100, from the same source and through the same ptxas (docs/attention.md). Where the installed Triton is older than
3.9, the kernel is launched with Triton's ``ir_override`` option naming the shipped PTX of its dtype and mask: Triton
builds the launch from the source as usual and assembles that PTX in place of its own. From Triton 3.9 on, Triton
compiles the source itself. The files are written on any machine, no GPU needed:

    python -m lm_systems.attention.hopper.ptx      # with Triton >= 3.9: compiled/*.ptx and compiled/manifest.json

and ``tests/attention/test_hopper_ptx.py`` fails when the kernel's sources change without them.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import itertools
import json
import re
from pathlib import Path

import torch
import triton

COMPILED = Path(__file__).with_name("compiled")
MANIFEST = COMPILED / "manifest.json"
OWN_CODE_FROM = (3, 9)  # the first Triton whose own code of the kernel is the shipped one's
TARGET_PTX_VERSION = "8.7"  # the PTX ISA of CUDA 12.8's ptxas, which Triton 3.6 ships
# do_not_specialize in the kernel: the rows of the dQ accumulator and of the row statistics are N_q rounded to 4 apart
UNSPECIALISED = ("stride_dqn", "stride_stats")
MULTIPLE = 16  # Triton's specialisation of the other strides (elements) and of the pointers (bytes)
HEAD_DIMS = (64, 128)  # the backward's, each its own PTX
# The backward's tiles and warps, as launched (dispatch) and as its PTX is compiled
BACKWARD_CONFIG = {"STAGES": 2, "num_warps": 4}
# Query rows a tile by head dim: at d 64 128, FlashAttention-3's d 64 tile (each product twice as wide for the same
# per-tile work that does not scale with d); at d 128 64, all shared memory allows
BACKWARD_ROWS = {64: 128, 128: 64}
# What the shipped PTX is compiled from: a change to any of these must be followed by the command above.
SOURCES = ("backward.py", "gluon_common.py", "partition_exit.py", "ptx.py", "../../compat/gluon.py")
_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def ptx_name(dtype: str, is_causal: bool, head_dim: int) -> str:
    """The file of the backward's PTX for a dtype ("bf16", "fp16"), a mask and a head dim."""
    return f"backward_d{head_dim}_{dtype}_{'causal' if is_causal else 'full'}.ptx"


def backward_launch_options(dtype: torch.dtype, is_causal: bool, head_dim: int) -> dict:
    """The backward's launch options: ``backward_config``, the mask, and Triton's ``ir_override``
    naming the shipped PTX where the installed Triton is older than 3.9."""
    options = {**backward_config(head_dim), "CAUSAL": is_causal}
    if _triton_version() < OWN_CODE_FROM:
        options["ir_override"] = str(COMPILED / ptx_name(_DTYPES[dtype], is_causal, head_dim))
    return options


def backward_config(head_dim: int) -> dict:
    """``BACKWARD_CONFIG`` with the head dim and its query rows a tile (``BACKWARD_ROWS``)."""
    return {**BACKWARD_CONFIG, "BLOCK_M": BACKWARD_ROWS[head_dim], "HEAD_DIM": head_dim}


@functools.cache
def _triton_version() -> tuple[int, int]:
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


def backward_ptx(dtype: str, is_causal: bool, head_dim: int) -> str:
    """The kernel's PTX for sm_90 as the installed Triton compiles it for ``backward_config``, specialised as
    launches are (pointers and the strides of q, k, v, dO, dK, dV multiples of ``MULTIPLE``), without its line table
    (it names this machine's paths), at the PTX version Triton 3.6's ptxas reads."""
    from lm_systems.attention.hopper.backward import gluon_backward_kernel
    from lm_systems.compat.gluon import sm90_ptx

    names = gluon_backward_kernel.arg_names
    signature = {name: _argument_type(name, dtype) for name in names}
    attrs = {
        (i,): [["tt.divisibility", MULTIPLE]]
        for i, name in enumerate(names)
        if signature[name].startswith("*") or (name.startswith("stride_") and name not in UNSPECIALISED)
    }
    constexprs = {**backward_config(head_dim), "CAUSAL": is_causal}
    num_warps = constexprs.pop("num_warps")
    ptx = sm90_ptx(gluon_backward_kernel, signature, constexprs, attrs, num_warps)
    ptx = re.sub(r"^\.version \d+\.\d+$", f".version {TARGET_PTX_VERSION}", ptx, count=1, flags=re.M)
    return _without_line_table(ptx)


def _argument_type(name: str, dtype: str) -> str:
    if name in ("STATS", "DQ_ACC"):
        return "*fp32"
    if name in ("Q", "K", "V", "DO", "DK", "DV"):
        return f"*{dtype}"
    if name == "sm_scale":
        return "fp32"
    if name.startswith("stride_") or name in ("num_heads", "n_q", "n_k"):
        return "i32"
    return "constexpr"


def _without_line_table(ptx: str) -> str:
    """The PTX less its ``.file`` and ``.loc`` directives and its DWARF sections (the code is untouched)."""
    code = ptx.split("\t.section\t.debug")[0]
    kept = [line for line in code.splitlines() if not line.lstrip().startswith((".file", ".loc"))]
    return "\n".join(kept).rstrip() + "\n"


def sources_digest() -> str:
    """sha256 of the kernel's sources, as the manifest records it."""
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update((Path(__file__).parent / name).resolve().read_bytes())
    return digest.hexdigest()


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    if _triton_version() < OWN_CODE_FROM:
        raise SystemExit(f"Triton {triton.__version__}: write the PTX with Triton 3.9 or later (its code is the point)")
    COMPILED.mkdir(exist_ok=True)
    for old in COMPILED.glob("*.ptx"):
        old.unlink()
    for dtype, is_causal, head_dim in itertools.product(_DTYPES.values(), (True, False), HEAD_DIMS):
        (COMPILED / ptx_name(dtype, is_causal, head_dim)).write_text(backward_ptx(dtype, is_causal, head_dim))
    MANIFEST.write_text(json.dumps({"triton": triton.__version__, "sources_sha256": sources_digest()}, indent=1) + "\n")
    print(f"wrote {COMPILED} with Triton {triton.__version__}")


if __name__ == "__main__":
    main()
