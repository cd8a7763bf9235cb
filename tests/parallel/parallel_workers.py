"""Worker processes for the container tests: a toy model with every awkward kind of parameter, trained
data-parallel on two gloo ranks and, on rank 0, single-process on the same global batch as the reference.

Module level (picklable) so that torch.multiprocessing.spawn can start them.
"""

from __future__ import annotations

import copy
import os
import threading
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from lm_systems.parallel import BucketedDDP, NaiveDDP, PerParameterDDP, ShardedOptimizer
from lm_systems.parallel.collectives import GradientAverager

VOCAB, DIM, BATCH, STEPS, MICRO_BATCHES = 37, 13, 3, 3, 2
TIMEOUT = timedelta(seconds=60)


class ToyNet(nn.Module):
    """Tied embedding/head, a frozen layer, a layer no rank uses, one only rank 0 uses, and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.never_used = nn.Linear(DIM, 3)  # registered first: its unit launches last, so others overlap
        self.embed = nn.Embedding(VOCAB, DIM)
        self.hidden = nn.Linear(DIM, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.rank0_only = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.rand(DIM) + 0.5)

    def forward(self, tokens: torch.Tensor, use_rank0_only: bool) -> torch.Tensor:
        x = self.embed(tokens) * self.scale  # (B, T, D)
        x = torch.tanh(self.hidden(x)) + self.frozen(x)
        if use_rank0_only:
            x = x + self.rank0_only(x)
        return self.head(x)  # (B, T, V)


def shard_loss(model: nn.Module, tokens: torch.Tensor, rank: int) -> torch.Tensor:
    logits = model(tokens[:, :-1], rank == 0)
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def global_batches(world_size: int, micro_batches: int) -> list[torch.Tensor]:
    """(steps, ranks, micro-batches) of token windows, the same on every rank."""
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, VOCAB, (world_size, micro_batches, BATCH, 7), generator=g) for _ in range(STEPS)]


def make_optimizer(
    model: nn.Module, sharded: str | None, exchange_stages: int = 1, process_group: dist.ProcessGroup | None = None
) -> torch.optim.Optimizer:
    """AdamW over two groups; the sharded one (``sharded``: its exchange) gets its second group through
    add_param_group."""
    named = dict(model.named_parameters())
    first = [named[n] for n in ("embed.weight", "hidden.weight", "hidden.bias")]
    second = [
        p for n, p in named.items() if p.requires_grad and n not in ("embed.weight", "hidden.weight", "hidden.bias")
    ]
    # A large eps keeps the update sensitive to the gradient scale (plain Adam is nearly scale-invariant).
    kwargs = dict(lr=0.05, weight_decay=0.1, betas=(0.8, 0.9), eps=0.1)
    if sharded is None:
        return torch.optim.AdamW([{"params": first}, {"params": second, "lr": 0.02}], **kwargs)
    optimizer = ShardedOptimizer(
        first,
        torch.optim.AdamW,
        exchange=sharded,
        exchange_stages=exchange_stages,
        process_group=process_group,
        **kwargs,
    )
    optimizer.add_param_group({"params": second, "lr": 0.02})
    return optimizer


def reference_training(initial: nn.Module, world_size: int, micro_batches: int):
    """Single process on the global batch: the mean of every rank's and micro-batch's loss."""
    model = copy.deepcopy(initial)
    optimizer = make_optimizer(model, None)
    for batch in global_batches(world_size, micro_batches):
        optimizer.zero_grad()
        loss = sum(shard_loss(model, batch[r, m], r) for r in range(world_size) for m in range(micro_batches)) / (
            world_size * micro_batches
        )
        loss.backward()
        optimizer.step()
    return model, optimizer


class AllReduceCounter:
    """Counts all-reduces (gradient averages: GradientAverager.start, and any dist.all_reduce call) and
    names the threads that issued them."""

    def __init__(self) -> None:
        self.calls = 0
        self.threads: set[str] = set()
        self._originals = [(dist, "all_reduce", dist.all_reduce), (GradientAverager, "start", GradientAverager.start)]

    def __enter__(self) -> "AllReduceCounter":
        for owner, name, original in self._originals:
            setattr(owner, name, self._counting(original))
        return self

    def _counting(self, original):
        def counting(*args, **kwargs):
            self.calls += 1
            self.threads.add(threading.current_thread().name)
            return original(*args, **kwargs)

        return counting

    def __exit__(self, *exc) -> None:
        for owner, name, original in self._originals:
            setattr(owner, name, original)


def compiled_hidden(model: ToyNet) -> ToyNet:
    """``model`` with its hidden layer torch.compiled: its gradients come out of a compiled backward node."""
    model.hidden.compile(backend="aot_eager")  # graph capture without code generation: quick on a CPU
    return model


def frozen_never_used(model: ToyNet) -> ToyNet:
    """``model`` with ``never_used`` frozen: rank 0 then holds every synchronised gradient itself."""
    model.never_used.requires_grad_(False)
    return model


CONTAINERS = {
    "naive": lambda m: NaiveDDP(m),
    "naive_flat": lambda m: NaiveDDP(m, flat=True),
    "individual": lambda m: PerParameterDDP(m),
    "bucketed": lambda m: BucketedDDP(m, bucket_size_mb=0.002),  # ~2 KB: several buckets
    "bucketed_one_bucket": lambda m: BucketedDDP(m, bucket_size_mb=100),
    "bucketed_bf16_comm": lambda m: BucketedDDP(m, bucket_size_mb=0.002, grad_comm_dtype=torch.bfloat16),
    "individual_launch_thread": lambda m: PerParameterDDP(m, launch_thread=True),
    "bucketed_launch_thread": lambda m: BucketedDDP(m, bucket_size_mb=0.002, launch_thread=True),
    "bucketed_compiled_layer": lambda m: BucketedDDP(compiled_hidden(m), bucket_size_mb=0.002),
    "bucketed_frozen_never_used": lambda m: BucketedDDP(frozen_never_used(m), bucket_size_mb=0.002),
}


# Gradients averaged in bf16 match the fp32 reference only to bf16's precision.
TOLERANCE = {"bucketed_bf16_comm": 2e-3}


def train_with(
    container: str,
    rank: int,
    world_size: int,
    set_to_none: bool = True,
    sharded: str | None = None,
    exchange_stages: int = 1,
    exchange_group: dist.ProcessGroup | None = None,
):
    """Train a fresh, rank-seeded ToyNet; returns (what the tests check, the container, its optimizer)."""
    torch.manual_seed(100 + rank)  # every rank starts from different weights: the container must broadcast
    before = ToyNet()
    model = CONTAINERS[container](copy.deepcopy(before))
    initial = copy.deepcopy(model.module)  # rank 0's weights, after the broadcast
    optimizer = make_optimizer(model.module, sharded, exchange_stages, exchange_group)
    report = {"no_sync_all_reduces": 0, "all_reduces_during_backward": []}
    for batch in global_batches(world_size, MICRO_BATCHES):
        optimizer.zero_grad(set_to_none=set_to_none)
        with AllReduceCounter() as counter, model.no_sync():
            (shard_loss(model, batch[rank, 0], rank) / MICRO_BATCHES).backward()
        report["no_sync_all_reduces"] += counter.calls
        with AllReduceCounter() as counter:
            (shard_loss(model, batch[rank, 1], rank) / MICRO_BATCHES).backward()
            report["all_reduces_during_backward"].append(counter.calls)
            model.finish_gradient_synchronization()
            optimizer.step()
        report["launching_threads"] = sorted(counter.threads)
        report["rank0_only_grad_is_none"] = model.module.rank0_only.weight.grad is None
        report["never_used_grad_is_none"] = model.module.never_used.weight.grad is None
    report["before"] = before.state_dict()
    report["initial"] = initial.state_dict()
    report["final"] = copy.deepcopy(model.module.state_dict())  # later steps must not change it
    if rank == 0:
        reference, reference_optimizer = reference_training(initial, world_size, MICRO_BATCHES)
        report["reference"] = reference.state_dict()
        report["reference_optimizer"] = reference_optimizer.state_dict()
    return report, model, optimizer


def init_group(rank: int, world_size: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=TIMEOUT)


def run_containers(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Every container, plus the bucketed one with ``zero_grad(set_to_none=False)``."""
    torch.set_num_threads(1)
    init_group(rank, world_size, port)
    try:
        runs = {name: train_with(name, rank, world_size)[0] for name in CONTAINERS}
        runs["bucketed_keep_grads"] = train_with("bucketed", rank, world_size, set_to_none=False)[0]
        torch.save(runs, Path(out_dir) / f"containers_rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_sharded(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """ShardedOptimizer over BucketedDDP with both exchanges; 1 exchange stage (the default), 4, or more
    stages than parameters; the exchange on its own group; its consolidated state, the order of one
    step's updates and exchanges, and loading a single-process AdamW state into the sharded optimizer
    (world size 1 → 2)."""
    torch.set_num_threads(1)
    init_group(rank, world_size, port)
    try:
        runs = {}
        own_group = dist.new_group(backend="gloo", timeout=TIMEOUT)
        for name, exchange, stages in SHARDED_RUNS:
            group = own_group if name.endswith("own_group") else None
            report, model, optimizer = train_with(
                "bucketed", rank, world_size, sharded=exchange, exchange_stages=stages, exchange_group=group
            )
            named = [(n, p) for n, p in model.module.named_parameters() if p.requires_grad]
            report["owned"] = [n for n, p in named if optimizer.owner(p) == rank]
            report["state_keys"] = [n for n, p in named if p in optimizer.state]
            optimizer.consolidate_state_dict(to=0)
            if rank == 0:
                report["consolidated"] = copy.deepcopy(optimizer.state_dict())
            report["step_order"] = step_order(model, optimizer, rank)
            runs[name] = report
        runs["resumed_from_single_process"] = resume_from_single_process(rank, world_size, runs["p2p"])
        torch.save(runs, Path(out_dir) / f"sharded_rank{rank}.pt")
    finally:
        dist.destroy_process_group()


SHARDED_RUNS = [
    ("p2p", "p2p", 4),
    ("broadcast", "broadcast", 4),
    ("p2p_one_stage", "p2p", 1),
    ("p2p_many_stages", "p2p", 16),
    ("p2p_own_group", "p2p", 4),
    ("broadcast_own_group", "broadcast", 4),
]
# *_own_group: the exchange runs on a process group of its own, not the default one.


def step_order(model: BucketedDDP, optimizer: ShardedOptimizer, rank: int) -> list[str]:
    """One more training step, recording in order each stage's local update ("step") and each launch of
    a parameter exchange ("exchange" on the default group, "exchange@own" on another)."""
    events: list[str] = []

    def recording(original, group_of):
        def launch(*args, **kwargs):
            group = group_of(args, kwargs)
            events.append("exchange" if group in (None, dist.group.WORLD) else "exchange@own")
            return original(*args, **kwargs)

        return launch

    launchers = {
        "batch_isend_irecv": (dist.batch_isend_irecv, lambda args, kwargs: args[0][0].group),
        "broadcast": (dist.broadcast, lambda args, kwargs: kwargs.get("group")),
    }
    for name, (original, group_of) in launchers.items():
        setattr(dist, name, recording(original, group_of))
    hooks = [stage.register_step_post_hook(lambda *_: events.append("step")) for stage in optimizer._stages]
    try:
        optimizer.zero_grad()
        batch = torch.randint(0, VOCAB, (BATCH, 7), generator=torch.Generator().manual_seed(7 + rank))
        shard_loss(model, batch, rank).backward()
        model.finish_gradient_synchronization()
        optimizer.step()
    finally:
        for name, (original, _) in launchers.items():
            setattr(dist, name, original)
        for hook in hooks:
            hook.remove()
    return events


def resume_from_single_process(rank: int, world_size: int, report: dict) -> dict:
    """Load rank 0's single-process reference (weights + AdamW state) into a 2-rank sharded run, take one
    more step, and compare with the reference taking that step alone."""
    shared = [report.get("reference"), report.get("reference_optimizer")]
    dist.broadcast_object_list(shared, src=0)
    weights, optimizer_state = shared
    model = BucketedDDP(ToyNet(), bucket_size_mb=0.002)
    model.module.load_state_dict(weights)
    optimizer = make_optimizer(model.module, "p2p")
    # Optimizer.load_state_dict keeps same-device tensors as they are: copy so the report stays intact.
    optimizer.load_state_dict(copy.deepcopy(optimizer_state))
    batch = torch.randint(0, VOCAB, (world_size, BATCH, 7), generator=torch.Generator().manual_seed(99))
    optimizer.zero_grad()
    shard_loss(model, batch[rank], rank).backward()
    model.finish_gradient_synchronization()
    optimizer.step()
    result = {"final": model.module.state_dict()}
    if rank == 0:
        reference = ToyNet()
        reference.load_state_dict(weights)
        reference_optimizer = make_optimizer(reference, None)
        reference_optimizer.load_state_dict(copy.deepcopy(optimizer_state))
        (sum(shard_loss(reference, batch[r], r) for r in range(world_size)) / world_size).backward()
        reference_optimizer.step()
        result["reference"] = reference.state_dict()
    return result
