"""torch's private names, each behind one public name (tests: tests/compat/test_torch.py). Imports no Lightning."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import _foreach_copy_ as foreach_copy_  # noqa: F401  the fused per-list ops have no public name
from torch import _foreach_div_ as foreach_div_  # noqa: F401
from torch import _foreach_norm as foreach_norm  # noqa: F401
from torch.utils._pytree import tree_flatten, tree_unflatten  # noqa: F401  torch has no public pytree


def set_module_parameter(module: torch.nn.Module, name: str, value: Optional[torch.Tensor]) -> None:
    """Make ``value`` (a Parameter or a plain tensor, such as a gathered view) ``module``'s parameter ``name``, in
    place of the one there: no hooks, no checks, as the ZeRO-3 container swaps shards and full weights every step.
    ``register_parameter`` takes only Parameters and runs the global registration hooks."""
    module._parameters[name] = value


def dispatch_mode_active() -> bool:
    """Whether a TorchDispatchMode sees the ops run now (activation checkpointing's selective contexts, a FLOP
    counter, fake tensors): torch keeps its stack of those modes behind private names only."""
    return torch._C._len_torch_dispatch_stack() > 0


def compiled_whole(module: torch.nn.Module) -> bool:
    """Whether ``module``'s whole call, hooks included, runs torch.compiled: ``Module.compile()`` sets
    ``_compiled_call_impl``, which ``Module.__call__`` then runs in place of its own."""
    return getattr(module, "_compiled_call_impl", None) is not None


def launched_as_one(
    group: dist.ProcessGroup, device: torch.device, issue: Callable[[], list[dist.Work]]
) -> list[dist.Work]:
    """Run ``issue``, which launches collectives on ``group``, so that a backend able to group them (NCCL: one group
    call, one kernel) launches them together, else one by one; the Works to wait for. torch groups only all-reduces,
    all-gathers and reduce-scatters in public (``allreduce_coalesced``, ...); others, such as reduces to different
    roots, go through ProcessGroup's private coalescing pair."""
    if not group._get_backend(device).supports_coalescing:
        return issue()
    group._start_coalescing(device)
    try:
        issue()
    finally:
        work = group._end_coalescing(device)
    return [] if work is None else [work]  # None: nothing was launched


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the backward pass now running has finished (torch's FSDP does its last reductions so):
    autograd's engine queue, which torch exposes only through ``Variable._execution_engine``."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def unscales_in_step(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` itself unscales and skips on overflow (fused AdamW), as GradScaler asks it."""
    return getattr(optimizer, "_step_supports_amp_scaling", False)


def skip_step_on_device(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """Have the next ``step()`` of an optimizer that ``unscales_in_step`` leave the parameters alone where ``skip``
    (a 0-dim bool tensor) is true, without a host sync: its ``found_inf``, which GradScaler sets for it."""
    optimizer.found_inf = skip.float()


def can_scale_in_step(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``scale_in_step`` can have ``optimizer`` divide its gradients: one that ``unscales_in_step``, over
    plain tensors (a tensor subclass, such as FSDP2's DTensors, would be mixed with the plain divisor)."""
    first = next((p for group in optimizer.param_groups for p in group["params"]), None)  # every step: no list
    return unscales_in_step(optimizer) and (first is None or type(first.data) is torch.Tensor)


def scale_in_step(optimizer: torch.optim.Optimizer, divisor: Optional[torch.Tensor]) -> None:
    """Have the next ``step()`` of an optimizer that ``can_scale_in_step`` divide every gradient by ``divisor`` (a
    0-dim float tensor; None: by nothing) inside its own kernel, as GradScaler has it unscale (its ``grad_scale``)."""
    optimizer.grad_scale = divisor


def overflow_flags(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
    """The per-device overflow flags ``scaler.unscale_(optimizer)`` found (a flag may be replaced in the dict)."""
    return scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]


def record_memory_history(max_entries: Optional[int]) -> None:
    """Start recording CUDA allocations for a memory snapshot (``max_entries`` of them); None stops recording.
    torch documents these snapshot functions (torch_cuda_memory.html) under their private names."""
    if max_entries is None:
        torch.cuda.memory._record_memory_history(enabled=None)
    else:
        torch.cuda.memory._record_memory_history(max_entries=max_entries)


def dump_memory_snapshot(path: str) -> None:
    """Write the recorded allocations to ``path`` (a pickle that https://pytorch.org/memory_viz opens)."""
    torch.cuda.memory._dump_snapshot(path)


def sdpa_kernel_ops() -> set:
    """The aten ops ``scaled_dot_product_attention`` dispatches to on each backend (flash, memory-efficient, cuDNN,
    the CPU's flash), whose outputs an activation checkpointing policy tells apart from other ops."""
    aten = torch.ops.aten
    return {
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
    }
