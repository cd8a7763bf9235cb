"""Each adapter of lm_systems.compat.torch against the installed torch: a failure names the private name a new torch
release moved, so the adapter (and only it) is what to change."""

from __future__ import annotations

import inspect
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from lm_systems.compat import torch as compat


def broken(name: str) -> str:
    return f"torch {torch.__version__} moved or changed {name}: update lm_systems/compat/torch.py"


def test_foreach_ops_divide_and_copy_lists_in_place():
    sent, targets = [torch.full((3,), 4.0), torch.full((2,), 8.0)], [torch.zeros(3), torch.zeros(2)]
    compat.foreach_div_(sent, 2.0)
    compat.foreach_copy_(targets, sent)
    assert [t.tolist() for t in targets] == [[2.0] * 3, [4.0] * 2], broken("torch._foreach_div_ / _foreach_copy_")


def test_foreach_norm_takes_each_tensors_norm_in_the_dtype_asked():
    tensors = [torch.tensor([3.0, 4.0], dtype=torch.bfloat16), torch.tensor([[1.0], [-2.0]], dtype=torch.bfloat16)]
    norms = compat.foreach_norm(tensors, 2.0, dtype=torch.float32)
    assert [n.dtype for n in norms] == [torch.float32] * 2, broken("torch._foreach_norm's dtype")
    assert torch.allclose(torch.stack(norms), torch.tensor([5.0, 5.0**0.5])), broken("torch._foreach_norm")
    assert [n.item() for n in compat.foreach_norm(tensors, float("inf"))] == [4.0, 2.0]


def test_pytree_flattens_and_rebuilds():
    tree = {"a": (torch.ones(1), 2), "b": [torch.zeros(2)]}
    leaves, spec = compat.tree_flatten(tree)
    assert len(leaves) == 3, broken("torch.utils._pytree.tree_flatten")
    assert compat.tree_unflatten(leaves, spec)["a"][1] == 2, broken("torch.utils._pytree.tree_unflatten")


def test_set_module_parameter_swaps_what_forward_uses():
    layer = torch.nn.Linear(2, 1, bias=False)
    compat.set_module_parameter(layer, "weight", torch.ones(1, 2))  # a plain tensor, as a gathered view
    assert layer(torch.ones(1, 2)).item() == 2.0, broken("nn.Module._parameters")


def test_end_of_backward_callbacks_run_after_the_whole_backward():
    order = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda grad: (compat.queue_end_of_backward(lambda: order.append("end")), order.append("hook"))[1])
    (y * 3).sum().backward()
    order.append("after")
    assert order == ["hook", "end", "after"], broken("torch.autograd.Variable._execution_engine.queue_callback")


def test_fused_adamw_unscales_in_step_and_skips_on_the_device():
    param = torch.nn.Parameter(torch.ones(3))
    fused = torch.optim.AdamW([param], lr=0.1, fused=True)
    assert compat.unscales_in_step(fused), broken("Optimizer._step_supports_amp_scaling")
    assert not compat.unscales_in_step(torch.optim.SGD([param], lr=0.1))
    param.grad = torch.ones(3)
    compat.skip_step_on_device(fused, torch.tensor(True))
    fused.step()
    assert torch.equal(param.detach(), torch.ones(3)), broken("fused AdamW's found_inf")
    compat.skip_step_on_device(fused, torch.tensor(False))
    fused.step()
    assert not torch.equal(param.detach(), torch.ones(3)), broken("fused AdamW's found_inf")


def test_fused_adamw_divides_the_gradients_in_its_step_as_told():
    """Two steps, the first with ``grad_scale`` 4: the update of the first gradient divided by 4 (Adam is blind to
    a scale that every step shares, not to one that changes between steps)."""

    def trained(grads: list[torch.Tensor], divisors: list) -> torch.Tensor:
        param = torch.nn.Parameter(torch.linspace(-1, 1, 5))
        optimizer = torch.optim.AdamW([param], lr=0.1, weight_decay=0.5, fused=True)
        for grad, divisor in zip(grads, divisors, strict=True):
            param.grad = grad.clone()
            assert compat.can_scale_in_step(optimizer)
            compat.scale_in_step(optimizer, divisor)
            optimizer.step()
        return param.detach()

    grads = [torch.tensor([0.4, -2.0, 8.0, 0.0, 1.0]), torch.tensor([-1.0, 3.0, 0.5, 2.0, -4.0])]
    divided = trained(grads, [torch.tensor(4.0), None])
    torch.testing.assert_close(divided, trained([grads[0] / 4, grads[1]], [None, None]))
    assert not torch.allclose(divided, trained(grads, [None, None])), broken("fused AdamW's grad_scale")
    param = torch.nn.Parameter(torch.ones(2))
    assert not compat.can_scale_in_step(torch.optim.AdamW([param], lr=0.1))


def test_overflow_flags_are_the_scalers_per_device_flags():
    param = torch.nn.Parameter(torch.ones(2))
    param.grad = torch.tensor([1.0, float("inf")])
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))  # as a training step's loss: the scale now exists
    scaler.unscale_(optimizer)
    flags = compat.overflow_flags(scaler, optimizer)
    assert [flag.item() for flag in flags.values()] == [1.0], broken("GradScaler._per_optimizer_states")


def test_memory_snapshot_functions_take_the_arguments_used():
    record = inspect.signature(torch.cuda.memory._record_memory_history).parameters
    assert {"enabled", "max_entries"} <= set(record), broken("torch.cuda.memory._record_memory_history")
    assert "filename" in inspect.signature(torch.cuda.memory._dump_snapshot).parameters, broken(
        "torch.cuda.memory._dump_snapshot"
    )


@pytest.mark.gpu
def test_a_memory_snapshot_is_written(tmp_path):
    compat.record_memory_history(1000)
    torch.ones(1024, device="cuda")
    compat.dump_memory_snapshot(str(tmp_path / "snapshot.pickle"))
    compat.record_memory_history(None)
    assert (tmp_path / "snapshot.pickle").stat().st_size > 0, broken("the CUDA memory snapshot")


def test_compiled_whole_sees_module_compile_but_not_a_compiled_forward():
    whole = torch.nn.Linear(2, 2)
    whole.compile()  # lazy: nothing is traced until a call
    forward_only = torch.nn.Linear(2, 2)
    forward_only.forward = torch.compile(forward_only.forward)
    assert compat.compiled_whole(whole), broken("Module._compiled_call_impl")
    assert not compat.compiled_whole(forward_only)
    assert not compat.compiled_whole(torch.nn.Linear(2, 2))


@pytest.fixture
def one_rank_group(request, tmp_path):
    """A one-process group of the backend the test names (``gloo`` unless parametrized), destroyed afterwards."""
    backend = getattr(request, "param", "gloo")
    dist.init_process_group(
        backend, init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, timeout=timedelta(seconds=60)
    )
    yield dist.group.WORLD
    dist.destroy_process_group()


def reduce_each_to_rank_0(group: dist.ProcessGroup, tensors: list[torch.Tensor]) -> list[dist.Work]:
    options = dist.ReduceOptions()
    options.rootRank, options.reduceOp = 0, dist.ReduceOp.SUM
    return [group.reduce([t], options) for t in tensors]


def test_the_coalescing_pair_is_where_launched_as_one_looks():
    for name in ("_start_coalescing", "_end_coalescing", "_get_backend"):
        assert hasattr(dist.ProcessGroup, name), broken(f"ProcessGroup.{name}")


def test_launched_as_one_falls_back_to_each_works_where_the_backend_cannot_group(one_rank_group):
    tensors = [torch.full((3,), 2.0), torch.full((5,), 3.0)]
    assert not one_rank_group._get_backend(torch.device("cpu")).supports_coalescing  # gloo
    works = compat.launched_as_one(
        one_rank_group, torch.device("cpu"), lambda: reduce_each_to_rank_0(one_rank_group, tensors)
    )
    for work in works:
        work.wait()
    assert len(works) == 2 and [t.tolist() for t in tensors] == [[2.0] * 3, [3.0] * 5]


@pytest.mark.gpu
@pytest.mark.parametrize("one_rank_group", ["nccl"], indirect=True)
def test_launched_as_one_groups_nccl_reduces_into_one_work(one_rank_group):
    device = torch.device("cuda", 0)
    tensors = [torch.full((3,), 2.0, device=device), torch.full((5,), 3.0, device=device)]
    works = compat.launched_as_one(one_rank_group, device, lambda: reduce_each_to_rank_0(one_rank_group, tensors))
    assert len(works) == 1, broken("ProcessGroup._start_coalescing / _end_coalescing")
    works[0].wait()
    assert [t.tolist() for t in tensors] == [[2.0] * 3, [3.0] * 5]


def test_sdpa_runs_one_of_the_kernel_ops_named():
    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    q = torch.randn(1, 2, 8, 16)
    with Ops():
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert set(seen) & compat.sdpa_kernel_ops()


def test_dispatch_mode_active_inside_a_torch_dispatch_mode_only():
    assert not compat.dispatch_mode_active()
    with TorchDispatchMode():
        assert compat.dispatch_mode_active()
    assert not compat.dispatch_mode_active()
