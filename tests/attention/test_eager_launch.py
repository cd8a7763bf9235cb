"""CachedLaunch: the first launch of a key goes through Triton, later ones straight to the compiled kernel
with the tuned meta-parameters in signature order; a change Triton would specialize on goes through Triton
again. A recording stand-in for the kernel makes this checkable without a GPU (the GPU test of flash_triton
runs the real kernels through it against a float64 reference)."""

import sys

import pytest
import torch

if sys.platform != "linux":
    pytest.skip("triton is installed on Linux only", allow_module_level=True)

import triton  # noqa: E402
from triton.compiler import CompiledKernel  # noqa: E402

from lm_systems.attention.eager_launch import CachedLaunch  # noqa: E402


class RecordedCompiledKernel(CompiledKernel):
    def __init__(self):  # no module to load: nothing runs
        self.module = None
        self.launches = []

    def __getitem__(self, grid):
        assert len(grid) == 3, "a compiled kernel's launcher indexes all three grid dimensions"
        return lambda *args: self.launches.append((grid, args))


class RecordingAutotunedKernel:
    """Stands in for ``triton.autotune(...)(kernel)``: X, stride, n positional; N_KEY, FIRST by keyword."""

    arg_names = ["X", "stride", "n", "N_KEY", "BLOCK", "FIRST"]

    def __init__(self):
        self.best_config = triton.Config({"BLOCK": 32})
        self.compiled = RecordedCompiledKernel()
        self.through_triton = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.through_triton.append((args, kwargs))
            return self.compiled

        return launch


def grid(meta):
    return triton.cdiv(100, meta["BLOCK"]), 2 if meta["FIRST"] else 1


def test_later_launches_go_to_the_compiled_kernel_with_the_tuned_config():
    kernel = RecordingAutotunedKernel()
    launch = CachedLaunch(kernel)
    x, y = torch.zeros(8), torch.zeros(8)
    launch[grid](x, 4, 100, N_KEY=128, FIRST=True)
    launch[grid](y, 4, 100, N_KEY=128, FIRST=True)
    assert len(kernel.through_triton) == 1
    ((launched_grid, args),) = kernel.compiled.launches
    assert launched_grid == (4, 2, 1)
    assert args[0] is y and args[1:] == (4, 100, 128, 32, True)


@pytest.mark.parametrize("change", ["misaligned tensor", "dtype", "int argument", "keyword argument"])
def test_what_triton_specializes_on_goes_through_triton_again(change):
    kernel = RecordingAutotunedKernel()
    launch = CachedLaunch(kernel)
    x = torch.zeros(8)
    launch[grid](x, 4, 100, N_KEY=128, FIRST=True)
    args, kwargs = [x, 4, 100], {"N_KEY": 128, "FIRST": True}
    if change == "misaligned tensor":
        args[0] = x[1:]  # 4 bytes past a 16-byte boundary
    elif change == "dtype":
        args[0] = x.half()
    elif change == "int argument":
        args[1] = 1
    else:
        kwargs["FIRST"] = False
    launch[grid](*args, **kwargs)
    assert len(kernel.through_triton) == 2 and not kernel.compiled.launches


def test_an_argument_left_to_its_default_is_refused():
    launch = CachedLaunch(RecordingAutotunedKernel())
    with pytest.raises(TypeError, match=r"missing or unknown: \['FIRST'\]"):
        launch[(1,)](torch.zeros(8), 4, 100, N_KEY=128)
