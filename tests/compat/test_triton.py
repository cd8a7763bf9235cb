"""Each adapter of lm_systems.compat.triton against the installed Triton: a failure names the internal a new Triton
release changed, so the adapter (and only it) is what to change. The launch itself needs a GPU (``gpu`` marker); on
the CPU the test checks the launcher's shape."""

from __future__ import annotations

import inspect
import sys

import pytest
import torch

if sys.platform != "linux":
    pytest.skip("triton is installed on Linux only", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from lm_systems.compat import triton as compat  # noqa: E402


def broken(name: str) -> str:
    return f"triton {triton.__version__} moved or changed {name}: update lm_systems/compat/triton.py"


def test_a_compiled_kernel_is_launched_by_indexing_it_with_a_grid():
    kernel_class = getattr(triton.compiler, "CompiledKernel", None)
    assert inspect.isclass(kernel_class), broken("triton.compiler.CompiledKernel")
    assert callable(getattr(kernel_class, "__getitem__", None)), broken("CompiledKernel[grid](*args)")
    assert compat.compiled_kernel(object()) is None
    assert compat.compiled_kernel(kernel_class.__new__(kernel_class)) is not None


@triton.jit
def _add_one(X, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(X + offsets, tl.load(X + offsets, mask=offsets < n) + 1, mask=offsets < n)


@pytest.mark.gpu
def test_the_compiled_kernel_a_launch_returned_launches_again():
    x = torch.zeros(100, device="cuda")
    compiled = compat.compiled_kernel(_add_one[(4,)](x, 100, BLOCK=32))
    assert compiled is not None, broken("what kernel[grid](...) returns")
    compat.launch_compiled(compiled, (4,), (x, 100, 32))
    torch.cuda.synchronize()
    assert torch.equal(x, torch.full((100,), 2.0, device="cuda")), broken("CompiledKernel[grid](*args)")
