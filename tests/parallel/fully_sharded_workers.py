"""Worker processes for the FullyShardedDataParallel tests: a toy model with every awkward kind of parameter,
trained on two gloo ranks and, on rank 0, in one process on the same global batch as the reference.

Module level (picklable) so that torch.multiprocessing.spawn can start them.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from parallel_workers import init_group
from torch.func import functional_call

from lm_systems.model.config import ModelConfig
from lm_systems.model.transformer import TransformerLM
from lm_systems.parallel import FullyShardedDataParallel, sharded_unit
from lm_systems.parallel.fully_sharded import DEFAULT_UNIT_TYPES

VOCAB, DIM, BATCH, STEPS, MICRO_BATCHES = 37, 13, 3, 3, 2
CLIP = 0.5  # below the toy's gradient norms: every step clips
# The modules FullyShardedDataParallel's default unit types pick out of ShardToy that hold their own parameters
# (tied_a / tied_b share theirs, so it stays replicated, and they hold none).
UNITS = ["never_used", "embed", "hidden", "frozen", "block.up", "block.down", "head"]
COMPUTE_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Block(nn.Module):
    """Not a unit type: its linear layers are units of their own, its gain stays replicated."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.rand(DIM) + 0.5)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.silu(self.up(x * self.gain.to(x.dtype))))


class ShardToy(nn.Module):
    """Row counts not divisible by 2 (37, 13, 3), a layer no rank uses, a frozen one, a weight shared by two
    layers (replicated), parameters outside any unit, a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.never_used = nn.Linear(DIM, 3)  # registered first
        self.embed = nn.Embedding(VOCAB, DIM)
        self.hidden = nn.Linear(DIM, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.block = Block()
        self.gain = nn.Parameter(torch.rand(DIM) + 0.5)
        self.tied_a = nn.Linear(DIM, DIM, bias=False)
        self.tied_b = nn.Linear(DIM, DIM, bias=False)
        self.tied_b.weight = self.tied_a.weight
        self.head = nn.Linear(DIM, VOCAB)
        self.register_buffer("scale", torch.rand(DIM) + 0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) * self.scale  # (B, T, D)
        x = torch.tanh(self.hidden(x)) + self.frozen(x)
        x = self.block(x) * self.gain  # float32 from here: the shared weight is not cast
        x = x + self.tied_b(torch.tanh(self.tied_a(x)))
        return self.head(x)  # (B, T, V)


def loss_of(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def global_batches() -> list[torch.Tensor]:
    """(steps) of (ranks, micro-batches, B, T+1) token windows, the same on every rank."""
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, VOCAB, (2, MICRO_BATCHES, BATCH, 7), generator=g) for _ in range(STEPS)]


def make_optimizer(params) -> torch.optim.Optimizer:
    # A large eps keeps the update sensitive to the gradient scale (plain Adam is nearly scale-invariant).
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1, betas=(0.8, 0.9), eps=0.1)


def cast_forward(model: ShardToy, tokens: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """The reference for ``compute_dtype``: the units' own parameters and floating inputs cast to ``dtype``
    for forward and backward; the float32 masters get the gradients."""
    if dtype is None:
        return model(tokens)
    cast_names = {f"{unit}.{name}" for unit in UNITS for name, _ in model.get_submodule(unit).named_parameters()}
    params = {name: p.to(dtype) if name in cast_names else p for name, p in model.named_parameters()}
    hooks = [
        model.get_submodule(unit).register_forward_pre_hook(
            lambda m, args: tuple(a.to(dtype) if a.is_floating_point() else a for a in args)
        )
        for unit in UNITS
    ]
    try:
        return functional_call(model, params, (tokens,))
    finally:
        for hook in hooks:
            hook.remove()


def reference_training(initial: ShardToy, dtype: torch.dtype | None) -> tuple[ShardToy, torch.optim.Optimizer, list]:
    """One process, the mean loss over every rank's micro-batches, clipped at CLIP."""
    model = copy.deepcopy(initial)
    optimizer = make_optimizer(model.parameters())
    norms = []
    for batch in global_batches():
        optimizer.zero_grad()
        windows = batch.flatten(0, 1)  # (ranks · micro-batches, B, T+1)
        loss = sum(loss_of(cast_forward(model, w[:, :-1], dtype), w) for w in windows) / len(windows)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
        optimizer.step()
    return model, optimizer, norms


class CollectiveLog:
    """Records, in order, every all-gather and reduce-scatter launched, every reduce-scatter finished (waited for)
    and every unit forward completed."""

    def __init__(self, model: FullyShardedDataParallel) -> None:
        self.events: list[str] = []
        self._model = model
        self._originals = {
            name: getattr(sharded_unit, name) for name in ("_all_gather_params", "_reduce_scatter_grads")
        }

    def __enter__(self) -> "CollectiveLog":
        for name, original in self._originals.items():

            def launch(*args, _name=name, _original=original, **kwargs):
                self.events.append("all_gather" if _name == "_all_gather_params" else "reduce_scatter")
                return _original(*args, **kwargs)

            setattr(sharded_unit, name, launch)
        finish = sharded_unit.ShardedUnit.finish_reduce_scatter

        def logged_finish(unit, pending):
            self.events.append("finish_reduce_scatter")
            return finish(unit, pending)

        self._finish = finish
        sharded_unit.ShardedUnit.finish_reduce_scatter = logged_finish
        self._hooks = [
            self._model.module.get_submodule(unit).register_forward_hook(
                lambda m, a, o, _unit=unit: self.events.append(f"forward {_unit}")
            )
            for unit in UNITS
        ]
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._originals.items():
            setattr(sharded_unit, name, original)
        sharded_unit.ShardedUnit.finish_reduce_scatter = self._finish
        for hook in self._hooks:
            hook.remove()


def train_sharded(rank: int, dtype_name: str, compiled: bool = False, prefetch: int = 1) -> dict:
    """Rank-seeded ShardToy (the wrapper broadcasts rank 0's), two micro-batches per step (the first under
    no_sync), clipped at CLIP; what the tests compare. ``compiled``: every unit's forward torch.compiled (as
    ``TransformerLM.compile_blocks`` does), its gather and free hooks left outside the graph. ``prefetch``: units
    whose all-gather starts ahead."""
    dtype = COMPUTE_DTYPES[dtype_name]
    torch.manual_seed(100 + rank)
    toy = ShardToy()
    if compiled:
        for module in toy.modules():
            if isinstance(module, DEFAULT_UNIT_TYPES):
                module.forward = torch.compile(module.forward, backend="aot_eager")  # graph capture, no codegen: quick
    model = FullyShardedDataParallel(toy, compute_dtype=dtype, prefetch=prefetch)
    initial = {name: value.clone() for name, value in model.gather_full_params().items()}
    optimizer = make_optimizer(model.module.parameters())
    report = {"norms": [], "logs": []}
    for batch in global_batches():
        optimizer.zero_grad()
        with CollectiveLog(model) as no_sync_log, model.no_sync():
            (loss_of(model(batch[rank, 0, :, :-1]), batch[rank, 0]) / MICRO_BATCHES).backward()
        with CollectiveLog(model) as sync_log:
            (loss_of(model(batch[rank, 1, :, :-1]), batch[rank, 1]) / MICRO_BATCHES).backward()
            sync_log.events.append("finish")
            model.finish_gradient_synchronization()
        report["logs"].append((no_sync_log.events, sync_log.events))
        report["norms"].append(model.clip_grad_norm_(CLIP))
        optimizer.step()
    report["grad_is_none"] = {name: p.grad is None for name, p in model.module.named_parameters()}
    report["shard_shapes"] = {name: tuple(p.shape) for name, p in model.module.named_parameters()}
    report["final"] = model.gather_full_params()
    report["full_optimizer"] = model.full_optimizer_state_dict(optimizer)
    report["full_state"] = model.full_state_dict()
    model.remove_hooks()
    report["hooks_left"] = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.module.modules())
    report["unwrapped"] = {name: p.detach().clone() for name, p in model.module.named_parameters()}
    if rank == 0:
        reference_initial = ShardToy()
        reference_initial.load_state_dict({**initial, "scale": model.module.scale})
        reference, reference_optimizer, norms = reference_training(reference_initial, dtype)
        report["reference"] = dict(reference.named_parameters(remove_duplicate=False))
        report["reference_optimizer"] = reference_optimizer.state_dict()
        report["reference_norms"] = norms
        report["initial"] = initial
    return report


def run_fully_sharded(rank: int, world_size: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_group(rank, world_size, port)
    try:
        runs = {name: train_sharded(rank, name) for name in COMPUTE_DTYPES}
        runs["fp32_compiled"] = train_sharded(rank, "fp32", compiled=True)
        runs["fp32_prefetch"] = {depth: train_sharded(rank, "fp32", prefetch=depth) for depth in (0, 2, 9)}
        runs["memory"] = resident_bytes_after_training(rank)
        torch.save(runs, Path(out_dir) / f"fully_sharded_rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view counts its whole storage, once)."""
    seen = {}
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
            seen[storage.data_ptr() or id(t)] = storage.nbytes()
    return sum(seen.values())


def resident_bytes_after_training(rank: int) -> dict:
    """Two AdamW steps of a small TransformerLM (vocabulary 65: rows not divisible by 2), then the bytes of
    parameter and gradient storage this rank holds: module parameters, their gradients, and the gathered
    copies the wrapper keeps between uses."""
    torch.manual_seed(0)
    config = ModelConfig.from_name(
        "tiny", vocab_size=65, d_model=32, num_layers=2, num_heads=2, d_ff=48, context_length=16
    )
    lm = TransformerLM(config)
    model = FullyShardedDataParallel(lm, units=lm.blocks)
    optimizer = make_optimizer(model.module.parameters())
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        tokens = torch.randint(0, 65, (2, 9), generator=g)
        optimizer.zero_grad()
        loss_of(model(tokens[:, :-1]), tokens).backward()
        model.finish_gradient_synchronization()
        optimizer.step()
    params = list(model.module.parameters())
    gathered = [t for unit in model._units for p in unit.params for t in (p.full, p.full.grad)]
    return {
        "resident": storage_bytes(params + [p.grad for p in params] + gathered),
        "gathered": storage_bytes(gathered),
        "model_shapes": {
            name: (tuple(p.shape), p.element_size()) for name, p in TransformerLM(config).named_parameters()
        },
    }
