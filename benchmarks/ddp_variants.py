"""The data-parallel variants ``bench.ddp`` compares, built the same way on every rank.

A variant is a name with options after ``+`` (``bucketed_25+thread+hp``):

- ``single``: rank 0 alone, no communication (the scaling baseline; the other ranks wait);
- ``torch_ddp``: torch DistributedDataParallel with its defaults (Lightning's ``ddp``);
- ``naive``, ``overlap``, ``bucketed_<MB>``: lm_systems.parallel's NaiveDDP, PerParameterDDP, BucketedDDP;
- ``zero1``: BucketedDDP (25 MB) + ShardedOptimizer.

Options, the strategies' own: ``+hp`` all-reduces on an NCCL group with a high-priority stream
(``comm_high_priority``), ``+thread`` launches them from a thread of their own (``launch_thread``),
``+stages<k>`` pipelines zero1's parameter exchange in k stages (``exchange_stages``). Without options a
variant runs the container's defaults, not the strategy's: the strategies add ``+thread``, zero1 ``+hp+stages4``.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from lm_systems.model.config import ModelConfig
from lm_systems.model.transformer import TransformerLM
from lm_systems.parallel import BucketedDDP, NaiveDDP, PerParameterDDP, ShardedOptimizer

BASES = ("single", "torch_ddp", "naive", "overlap", "zero1")
OPTIONS = "+hp, +thread, +stages<k>"


@dataclass(frozen=True)
class Variant:
    """A parsed variant name: ``base[+option...]``."""

    base: str
    high_priority: bool = False
    launch_thread: bool = False
    exchange_stages: int | None = None  # None: ShardedOptimizer's default

    @classmethod
    def parse(cls, name: str) -> Variant:
        base, *options = name.split("+")
        if base not in BASES and not (base.startswith("bucketed_") and _is_positive(base[9:])):
            raise ValueError(f"unknown variant {base!r}: choose from {', '.join(BASES)} or bucketed_<MB>")
        fields: dict = {}
        for option in options:
            stages = re.fullmatch(r"stages([1-9][0-9]*)", option)
            if option in ("hp", "thread"):
                fields["high_priority" if option == "hp" else "launch_thread"] = True
            elif stages:
                fields["exchange_stages"] = int(stages[1])
            else:
                raise ValueError(f"unknown option {option!r} in variant {name!r} (options: {OPTIONS})")
        if options and base == "single":
            raise ValueError("single communicates nothing: it takes no communication options")
        if fields.get("launch_thread") and base in ("torch_ddp", "naive"):
            raise ValueError(
                f"+thread needs a container that launches during backward (overlap, bucketed_<MB>, zero1), not {base!r}"
            )
        if "exchange_stages" in fields and base != "zero1":
            raise ValueError(f"+stages<k> sets zero1's exchange pipeline, not {base!r}'s")
        return cls(base, **fields)


def checked_variant(name: str) -> str:
    """An argparse type: ``name`` when it parses as a variant."""
    try:
        Variant.parse(name)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return name


def _is_positive(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


@dataclass
class Run:
    """One variant's model, wrapper and optimizer on this rank."""

    model: torch.nn.Module  # what forward is called on
    optimizer: torch.optim.Optimizer
    finish: Callable[[], None] = lambda: None  # the gradient sync left after backward
    close: Callable[[], None] = lambda: None  # closes the container: hooks off, launch thread stopped


def build(variant: Variant, config: ModelConfig, device: torch.device, group: dist.ProcessGroup | None) -> Run:
    """``variant`` on this rank over a fresh model (the same on every rank), all-reducing on ``group``."""
    torch.manual_seed(0)
    with device:
        model = TransformerLM(config)
    adamw = dict(lr=1e-4, fused=device.type == "cuda")
    optimizer = torch.optim.AdamW(model.parameters(), **adamw)
    base = variant.base
    if base == "single":
        return Run(model, optimizer)
    if base == "torch_ddp":
        device_ids = [device.index] if device.type == "cuda" else None
        return Run(DistributedDataParallel(model, device_ids, process_group=group), optimizer)
    if base == "naive":
        container = NaiveDDP(model, process_group=group)
    elif base == "overlap":
        container = PerParameterDDP(model, process_group=group, launch_thread=variant.launch_thread)
    else:
        bucket_mb = 25 if base == "zero1" else float(base.removeprefix("bucketed_"))
        container = BucketedDDP(model, bucket_mb, process_group=group, launch_thread=variant.launch_thread)
    if base == "zero1":
        stages = {} if variant.exchange_stages is None else {"exchange_stages": variant.exchange_stages}
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, process_group=group, **stages, **adamw)
    return Run(container, optimizer, container.finish_gradient_synchronization, container.close)


def make_step(run: Run, device: torch.device) -> Callable[..., None]:
    """One bf16-autocast training step of ``run``: ``step(batch, mark=None)``; ``mark()``, when given, is
    called after forward, backward, the gradient sync and the optimizer step (to time the phases)."""

    def step(batch: torch.Tensor, mark: Callable[[], None] = lambda: None) -> None:
        run.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = run.model(batch[:, :-1])  # (B, T, V)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        mark()
        loss.backward()
        mark()
        run.finish()
        mark()
        run.optimizer.step()
        mark()

    return step
