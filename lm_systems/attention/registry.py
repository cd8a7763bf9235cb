"""Name → attention function registry, with ``auto`` resolved per device."""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]

_REGISTRY: dict[str, AttentionFn] = {}

# ``auto``: sdpa, except inside torch.compile, where the first implementation registered with ``when_compiled``
# that takes the query is chosen (flash_triton for fp16 / bf16 on CUDA up to 2048 positions, and from 16,384 where
# its Hopper kernels run). Compiled, Inductor launches flash_triton's kernels itself; eager, its Python autograd path
# costs more host time than sdpa on a host-bound step (benchmarks/results/train_step.md, docs/attention.md).
_AUTO = "sdpa"


class AutoChoice(NamedTuple):
    """An implementation ``auto`` takes inside torch.compile for the queries ``takes(q)`` accepts (``says``: which)."""

    name: str
    takes: Callable[[torch.Tensor], bool]
    says: str


_AUTO_WHEN_COMPILED: list[AutoChoice] = []

DeviceProblem = Callable[[str], "str | None"]
"""What keeps an implementation off a device type ("cpu", "cuda"), in words, or None where it runs."""
_DEVICE_PROBLEMS: dict[str, DeviceProblem] = {}


def register_attention(
    name: str,
    when_compiled: Callable[[torch.Tensor], bool] | None = None,
    takes: str = "the queries it takes",
    device_problem: DeviceProblem | None = None,
) -> Callable[[AttentionFn], AttentionFn]:
    """Decorator: make ``fn`` available to the model as ``attention=name``; ``auto`` takes it inside
    torch.compile for the queries ``when_compiled(q)`` accepts, which ``takes`` says in words. Without
    ``device_problem`` it runs on every device."""

    def decorator(fn: AttentionFn) -> AttentionFn:
        if name in _REGISTRY or name == "auto":
            raise ValueError(f"attention {name!r} is already registered")
        _REGISTRY[name] = fn
        if device_problem is not None:
            _DEVICE_PROBLEMS[name] = device_problem
        if when_compiled is not None:
            _AUTO_WHEN_COMPILED.append(AutoChoice(name, when_compiled, takes))
        return fn

    return decorator


def attention_names() -> list[str]:
    """Every name ``get_attention`` accepts, ``auto`` included."""
    return ["auto", *sorted(_REGISTRY)]


def attention_device_problem(name: str, device_type: str) -> str | None:
    """Why ``name`` (``auto`` resolved eagerly) cannot run on ``device_type``, or None where it can."""
    problem = _DEVICE_PROBLEMS.get(resolve_attention_name(name))
    return problem(device_type) if problem is not None else None


def resolve_attention_name(name: str, query: torch.Tensor | None = None) -> str:
    """Map ``auto`` to its choice for ``query`` where it runs (eager or inside torch.compile); without a query,
    to the eager choice. Other names are returned as they are."""
    if name == "auto":
        if query is not None and torch.compiler.is_compiling():
            for choice in _AUTO_WHEN_COMPILED:
                if choice.takes(query):
                    return choice.name
        return _AUTO
    return name


def get_attention(name: str, query: torch.Tensor | None = None) -> AttentionFn:
    """The attention function registered as ``name`` (``auto`` resolved for ``query``); a name not in
    ``attention_names()`` is a KeyError (``ModelConfig`` checks the model's, with the names to choose from)."""
    return _REGISTRY[resolve_attention_name(name, query)]


def describe_attention(name: str, compiled: bool) -> str:
    """What ``name`` runs, in words: ``auto`` in eager code is its eager choice; compiled, it may differ per query."""
    if name != "auto":
        return name
    choices = "; ".join(f"{choice.name} for {choice.says}" for choice in _AUTO_WHEN_COMPILED)
    if not compiled or not choices:
        return _AUTO
    return f"auto: inside torch.compile {choices}, else {_AUTO}"
