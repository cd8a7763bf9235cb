"""The data-parallel variants the benchmarks compare, built the same way for every runner.

A variant is a name with options after ``+`` (``bucketed_25+thread+hp``):

- ``single``: rank 0 alone, no communication (the scaling baseline; the other ranks wait);
- ``no_comm``: every rank trains its own model, no communication: the ceiling of any gradient sync;
- ``torch_ddp``: torch DistributedDataParallel with its defaults (Lightning's ``ddp``); ``torch_ddp_view``:
  the same with ``gradient_as_bucket_view=True``; ``torch_zero``: + torch's ZeroRedundancyOptimizer;
- ``naive``, ``naive_flat``, ``overlap``, ``bucketed_<MB>``: lm_systems.parallel's containers;
- ``zero1`` (p2p parameter exchange), ``zero1_broadcast``: DDPBucketed (25 MB) + ShardedOptimizer.

Options, the strategies' own (any DDP variant, ours or torch's, so both get the same): ``+hp`` all-reduce
on an NCCL group with a high-priority stream (``comm_high_priority``), ``+ctas<k>`` at most k thread blocks
per all-reduce (``comm_max_ctas``), ``+bf16`` gradients sent in bf16 (``grad_comm_dtype``; torch DDP through
its ``bf16_compress_hook``); ours only: ``+thread`` launch from a thread of their own (``launch_thread``),
``+ce`` average by peer copies on the copy engines (``allreduce: copy_engine``), ``+stages<k>`` zero1's
exchange pipelined in k stages (``exchange_stages``).
"""

from __future__ import annotations

import argparse
import re
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from lm_systems.attention import attention_names
from lm_systems.bench.report import add_out_dir_arg
from lm_systems.config import ModelConfig
from lm_systems.model import TransformerLM
from lm_systems.parallel import DDPBucketed, DDPIndividualParameters, NaiveDDP, ShardedOptimizer

BASES = ["single", "no_comm", "torch_ddp", "torch_ddp_view", "torch_zero", "naive", "naive_flat", "overlap",
         "zero1", "zero1_broadcast"]
OPTIONS = "+hp, +ctas<k>, +bf16, +thread, +ce, +stages<k>"
FLAGS = {"hp": "high_priority", "bf16": "bf16_comm", "thread": "launch_thread", "ce": "copy_engine"}
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class Variant:
    """A parsed variant name: ``base[+option...]``."""

    base: str
    high_priority: bool = False
    max_ctas: int | None = None
    bf16_comm: bool = False
    launch_thread: bool = False
    copy_engine: bool = False
    exchange_stages: int | None = None  # None: ShardedOptimizer's default

    @classmethod
    def parse(cls, name: str) -> "Variant":
        base, *options = name.split("+")
        if base not in BASES and not (base.startswith("bucketed_") and _is_positive(base[9:])):
            raise ValueError(f"unknown variant {base!r}: choose from {', '.join(BASES)} or bucketed_<MB>")
        ours_bucketed = base.startswith(("bucketed_", "zero1"))
        fields: dict = {}
        for option in options:
            counted = re.fullmatch(r"(ctas|stages)([1-9][0-9]*)", option)
            if option in ("hp", "bf16", "thread", "ce"):
                fields[FLAGS[option]] = True
            elif counted and counted[1] == "ctas":
                fields.update(max_ctas=int(counted[2]), high_priority=True)  # a group of its own, high priority
            elif counted:
                fields["exchange_stages"] = int(counted[2])
            else:
                raise ValueError(f"unknown option {option!r} in variant {name!r} (options: {OPTIONS})")
        if options and base in ("single", "no_comm"):
            raise ValueError(f"{base} communicates nothing: it takes no communication options")
        if fields.get("launch_thread") and not (base == "overlap" or ours_bucketed):
            raise ValueError(f"+thread needs a container that launches during backward (overlap, bucketed_<MB>, "
                             f"zero1), not {base!r}")
        if fields.get("copy_engine") and not ours_bucketed:
            raise ValueError(f"+ce averages DDPBucketed's buckets (bucketed_<MB>, zero1), not {base!r}'s")
        if "exchange_stages" in fields and not base.startswith("zero1"):
            raise ValueError(f"+stages<k> sets zero1's exchange pipeline, not {base!r}'s")
        return cls(base, **fields)

    @property
    def group_key(self) -> tuple[bool, int | None] | None:
        """The (high priority, max CTAs) of the NCCL group of its own it asks for; None: the default group."""
        return (True, self.max_ctas) if self.high_priority else None


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
    cleanup: list[Callable[[], None]] = field(default_factory=list)


def build(variant: Variant, config: ModelConfig, device: torch.device, group: dist.ProcessGroup | None,
          compile_mode: str | None = None, lr: float = 1e-4) -> Run:
    """``variant`` on this rank, over a fresh model whose blocks are compiled in ``compile_mode`` (None: eager)."""
    torch.manual_seed(0)
    with device:
        model = TransformerLM(config)
    if compile_mode is not None:
        model.compile_blocks(mode=compile_mode)
        # Blocks compiled whole are torch DDP's best case: dynamo's DDPOptimizer would cut each block's
        # graph at DDP's bucket boundaries (it made torch_ddp's step slower under reduce-overhead).
        torch._dynamo.config.optimize_ddp = False
    adamw = dict(lr=lr, fused=device.type == "cuda")
    base = variant.base
    if base in ("single", "no_comm"):
        return Run(model, torch.optim.AdamW(model.parameters(), **adamw))
    if base.startswith("torch_"):
        wrapped = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                          gradient_as_bucket_view=base == "torch_ddp_view", process_group=group)
        if variant.bf16_comm:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

            wrapped.register_comm_hook(group, bf16_compress_hook)
        if base == "torch_zero":
            return Run(wrapped, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **adamw))
        return Run(wrapped, torch.optim.AdamW(model.parameters(), **adamw))
    comm = dict(process_group=group, grad_comm_dtype=torch.bfloat16 if variant.bf16_comm else None)
    bucketing = dict(allreduce="copy_engine" if variant.copy_engine else "process_group",
                     launch_thread=variant.launch_thread, **comm)
    if base.startswith("zero1"):
        container = DDPBucketed(model, bucket_size_mb=25, **bucketing)
        stages = {} if variant.exchange_stages is None else {"exchange_stages": variant.exchange_stages}
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, process_group=group,
                                     exchange="broadcast" if base.endswith("broadcast") else "p2p", **stages, **adamw)
        return Run(container, optimizer, container.finish_gradient_synchronization, [container.remove_hooks])
    if base.startswith("bucketed_"):
        container = DDPBucketed(model, bucket_size_mb=float(base[9:]), **bucketing)
    elif base == "overlap":
        container = DDPIndividualParameters(model, launch_thread=variant.launch_thread, **comm)
    else:
        container = NaiveDDP(model, flat=base == "naive_flat", **comm)
    return Run(container, torch.optim.AdamW(model.parameters(), **adamw), container.finish_gradient_synchronization,
               [container.remove_hooks])


def make_step(run: Run, precision: str, device: torch.device) -> Callable[..., None]:
    """One training step of ``run``: ``step(batch, mark=None)``; ``mark()``, when given, is called after
    forward, backward, the gradient sync and the optimizer step (to time the phases)."""
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16-mixed" else nullcontext()

    def step(batch: torch.Tensor, mark: Callable[[], None] = lambda: None) -> None:
        run.optimizer.zero_grad(set_to_none=True)
        with autocast:
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


def release(runs: list[Run | None]) -> None:
    """Detach the runs' containers; the caller drops its references and frees the memory."""
    for run in runs:
        for cleanup in run.cleanup if run is not None else []:
            cleanup()
    runs.clear()


def add_setup_args(parser: argparse.ArgumentParser) -> None:
    """The model, batch, precision and process flags every data-parallel benchmark shares."""
    parser.add_argument("--size", default="xl", help="model size (tiny, small, medium, large, xl, 2.7b)")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--context-length", type=int, default=512)
    parser.add_argument("--vocab-size", type=int, default=None, help="default: the size's (10,000)")
    parser.add_argument("--precision", choices=["bf16-mixed", "32-true"], default="bf16-mixed")
    parser.add_argument("--nproc", type=int, default=None, help="processes, one per GPU (default: all GPUs, or 2 on CPU)")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--attention", default="sdpa", help="the model's attention")
    parser.add_argument("--compile", nargs="?", const="default", choices=COMPILE_MODES, default=None,
                        help="torch.compile each Transformer block of every variant's model, in this mode "
                             "('reduce-overhead' replays each block's kernels as CUDA graphs); compiled in warm-up")
    parser.add_argument("--timeout-s", type=int, default=600, help="process-group timeout")
    add_out_dir_arg(parser)


def check_setup_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Resolve ``--device auto`` and the default ``--nproc``; refuse what cannot run."""
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.nproc is None:
        args.nproc = torch.cuda.device_count() if args.device == "cuda" else 2
    if args.device == "cuda" and args.nproc > torch.cuda.device_count():
        parser.error(f"--nproc {args.nproc} needs that many GPUs; {torch.cuda.device_count()} visible")
    if args.nproc < 2:
        parser.error("--nproc must be at least 2 (the single-GPU baseline runs inside the same job)")
    if args.attention not in attention_names():
        parser.error(f"unknown --attention {args.attention!r}; registered: {', '.join(attention_names())}")


def rank_config_and_batch(args: argparse.Namespace, rank: int, device: torch.device) -> tuple[ModelConfig, torch.Tensor]:
    """The model config the setup flags describe, and this rank's own batch of random tokens (B, T + 1)."""
    config = ModelConfig.from_name(args.size, context_length=args.context_length, attention=args.attention,
                                   vocab_size=args.vocab_size)
    g = torch.Generator(device=device).manual_seed(1000 + rank)
    batch = torch.randint(0, config.vocab_size, (args.batch_size, args.context_length + 1), device=device, generator=g)
    return config, batch


def setup_description(args: argparse.Namespace) -> str:
    """What the setup flags ran, for a results file's notes: ``xl, batch 4/rank, context 512, ...``."""
    compiled = ""
    if args.compile is not None:
        mode = "" if args.compile == "default" else f" (mode {args.compile})"
        compiled = f", every Transformer block torch.compiled{mode}"
    return (f"{args.size}, batch {args.batch_size}/rank, context {args.context_length}, {args.precision}, "
            f"{args.attention} attention{compiled}")


def run_label(args: argparse.Namespace) -> str:
    """``<size>_<nproc><gpu|cpu>[_compiled[_<mode>]]``: the part of a results file name that says what ran where."""
    compiled = ""
    if args.compile is not None:
        compiled = "_compiled" if args.compile == "default" else f"_compiled_{args.compile.replace('-', '_')}"
    return f"{args.size}_{args.nproc}{'gpu' if args.device == 'cuda' else 'cpu'}{compiled}"
