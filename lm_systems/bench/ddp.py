"""Data-parallel training benchmark: ``python -m lm_systems.bench.ddp --size xl --nproc 2``.

Trains a TransformerLM (default xl, batch 4 per rank, context 512, bf16 autocast, fused AdamW) in a
plain PyTorch loop on ``--nproc`` processes started with torch.multiprocessing (no torchrun, no
Lightning Trainer: the loop is the same for every variant, so the step times compare the gradient
synchronisation alone). Variants, all interleaved round by round, a fresh model each visit:

- ``single``: rank 0 alone, no communication (the scaling baseline; the other ranks wait);
- ``no_comm``: every rank trains its own model on its own data, no communication at all: the ceiling
  any gradient synchronisation can reach with all GPUs busy (not a default: its replicas differ);
- ``torch_ddp``: torch DistributedDataParallel with its defaults (Lightning's ``ddp``: 25 MB buckets,
  gradients copied into and out of the buckets); ``torch_ddp_view``: the same with
  ``gradient_as_bucket_view=True``;
- ``naive`` / ``naive_flat`` / ``overlap`` / ``bucketed_<MB>``: lm_systems.parallel's containers;
- ``zero1`` (p2p parameter exchange), ``zero1_broadcast``: DDPBucketed (25 MB) + ShardedOptimizer;
  ``torch_zero``: torch DDP + torch's ZeroRedundancyOptimizer, its baseline.

A variant may carry options after ``+`` (any DDP variant, ours or torch's, so both get the same):
``+hp`` all-reduces (zero1: and exchanges parameters) on an NCCL group with a high-priority stream, ``+ctas<k>`` caps that group's
all-reduces at k thread blocks, ``+normal`` uses such a group at normal priority, ``+bf16`` sends
gradients in bf16 (torch DDP through its ``bf16_compress_hook``), ``+carve<k>`` runs backward's
matmuls through cuBLASLt told to leave k SMs free (torch's experimental SM carve-out) for the
all-reduces; ``+thread`` (ours only) launches the all-reduces from a thread of their own instead of
autograd's (``launch_thread``); ``+stages<k>`` (zero1 only) pipelines its step and parameter exchange
in k stages (``exchange_stages``; the default, 1: step everything, then exchange); ``+ce`` (bucketed and
zero1) averages the buckets by peer copies over symmetric memory (``allreduce="copy_engine"``); ``+ostep<k>``
(overlap, bucketed_<MB>) steps AdamW in k stages of buckets, each as soon as its buckets are averaged,
while the later ones are still on the wire (``OverlappedStepOptimizer``: the sync_ms phase is then 0 and
the optimizer phase holds the rest of the averaging); ``+local``
(torch_ddp, bucketed_<MB>; a diagnostic, its replicas differ) runs the container with its gradient
collectives left out (hooks, bucket views and launches run, no gradient is sent; bucketed's one small
all-reduce of which parameters hold gradients still runs), pricing the container's own work apart from
communication. E.g.
``bucketed_25+hp``, ``torch_ddp+hp+bf16``, ``bucketed_25+thread``, ``zero1+thread+hp+stages4``, ``bucketed_25+thread+ce``,
``bucketed_25+ce+ostep4``.

Per variant: step time (median of per-step times, slowest rank), the phases of a few separately
instrumented steps (forward, backward, gradient sync left after backward, optimizer), with
``--profile`` the kernel timeline of one profiled step on rank 0 (NCCL time, the share of it hidden
under compute, the GPU's idle time within the step), tokens/s,
scaling efficiency (single-rank step time / step time: per-rank throughput against one GPU), peak
memory and optimizer-state bytes per rank, and whether all replicas hold identical weights after
training. Ratios to ``torch_ddp`` are taken within each round, then the median over rounds.
``--matrix`` adds attention implementations × (single, naive, bucketed_25, torch_ddp).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from lm_systems.attention import attention_names
from lm_systems.bench.gpu_timeline import profile_kernels
from lm_systems.bench.ranks import init_rank, spawn_ranks, synchronize
from lm_systems.bench.report import add_out_dir_arg, write_results
from lm_systems.config import ModelConfig
from lm_systems.model import TransformerLM
from lm_systems.parallel import (DataParallelModule, DDPBucketed, DDPIndividualParameters, NaiveDDP,
                                 OverlappedStepOptimizer, ShardedOptimizer, gradient_process_group)

GB = 1e9
DEFAULT_VARIANTS = ["single", "torch_ddp", "torch_ddp_view", "naive", "naive_flat", "overlap", "bucketed_1",
                    "bucketed_10", "bucketed_25", "bucketed_100", "bucketed_1000", "zero1", "zero1_broadcast",
                    "torch_zero"]
EXTRA_VARIANTS = ["no_comm"]
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")
VARIANT_OPTIONS = "+hp, +normal, +ctas<k>, +bf16, +carve<k>, +thread, +stages<k>, +ce, +ostep<k>, +local"
MATRIX_STRATEGIES = ["single", "naive", "bucketed_25", "torch_ddp"]
TIMELINE_COLUMNS = ["comm_ms", "comm_hidden_frac", "comm_exposed_ms", "gpu_idle_ms", "gpu_span_ms"]


@dataclass
class Run:
    """One variant's model, wrapper and optimizer on this rank."""

    model: torch.nn.Module  # what forward is called on
    optimizer: torch.optim.Optimizer
    finish: Callable[[], None] = lambda: None
    cleanup: list[Callable[[], None]] = field(default_factory=list)


@dataclass(frozen=True)
class Variant:
    """A parsed variant name: ``base[+option...]``."""

    base: str
    high_priority: bool | None = None  # None: the default group; True / False: a group of our own
    max_ctas: int | None = None
    bf16_comm: bool = False
    sm_carveout: int | None = None
    launch_thread: bool = False
    exchange_stages: int | None = None  # zero1's; None: ShardedOptimizer's default
    copy_engine: bool = False  # bucketed / zero1 averaging by peer copies (allreduce="copy_engine")
    step_stages: int | None = None  # OverlappedStepOptimizer's stages; None: a plain AdamW after the sync
    local: bool = False  # diagnostic: the container without its gradient collectives

    @classmethod
    def parse(cls, name: str) -> "Variant":
        base, *options = name.split("+")
        if base not in DEFAULT_VARIANTS + EXTRA_VARIANTS and not (base.startswith("bucketed_") and _is_number(base[9:])):
            raise ValueError(f"unknown variant {base!r}: choose from {', '.join(DEFAULT_VARIANTS + EXTRA_VARIANTS)} "
                             "or bucketed_<MB>")
        fields: dict = {}
        for option in options:
            if option in ("hp", "normal"):
                fields["high_priority"] = option == "hp"
            elif option.startswith("ctas") and option[4:].isdigit():
                fields["max_ctas"] = int(option[4:])
                fields.setdefault("high_priority", True)
            elif option == "bf16":
                fields["bf16_comm"] = True
            elif option.startswith("carve") and option[5:].isdigit():
                fields["sm_carveout"] = int(option[5:])
            elif option == "thread":
                fields["launch_thread"] = True
            elif option.startswith("stages") and option[6:].isdigit() and int(option[6:]) >= 1:
                fields["exchange_stages"] = int(option[6:])
            elif option == "ce":
                fields["copy_engine"] = True
            elif option.startswith("ostep") and option[5:].isdigit() and int(option[5:]) >= 1:
                fields["step_stages"] = int(option[5:])
            elif option == "local":
                fields["local"] = True
            else:
                raise ValueError(f"unknown option {option!r} in variant {name!r} (options: {VARIANT_OPTIONS})")
        if options and base in ("single", "no_comm"):
            raise ValueError(f"{base} communicates nothing: it takes no communication options")
        if fields.get("launch_thread") and not (base == "overlap" or base.startswith(("bucketed_", "zero1"))):
            raise ValueError(f"+thread needs a container that launches during backward (overlap, bucketed_<MB>, "
                             f"zero1), not {base!r}")
        if "exchange_stages" in fields and not base.startswith("zero1"):
            raise ValueError(f"+stages<k> sets zero1's exchange pipeline, not {base!r}'s")
        if fields.get("copy_engine") and not base.startswith(("bucketed_", "zero1")):
            raise ValueError(f"+ce averages DDPBucketed's buckets (bucketed_<MB>, zero1), not {base!r}'s")
        if "step_stages" in fields and not (base == "overlap" or base.startswith("bucketed_")):
            raise ValueError(f"+ostep<k> overlaps the step with overlap / bucketed_<MB>'s averaging, not {base!r}'s")
        if fields.get("local") and not (base == "torch_ddp" or base.startswith("bucketed_")):
            raise ValueError(f"+local applies to torch_ddp and bucketed_<MB>, not {base!r}")
        if fields.get("local") and any(fields.get(k) for k in ("copy_engine", "bf16_comm", "high_priority", "max_ctas")):
            raise ValueError("+local sends nothing: it takes no communication option (+ce, +bf16, +hp, +ctas<k>)")
        return cls(base, **fields)

    @property
    def group_key(self) -> tuple[bool, int | None] | None:
        return None if self.high_priority is None else (self.high_priority, self.max_ctas)


def variant_names(text: str) -> list[str]:
    """A ``--variants`` value: comma-separated variant names, each one checked."""
    names = text.split(",")
    for name in names:
        try:
            Variant.parse(name)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return names


def _is_number(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


def build(variant: Variant, config: ModelConfig, device: torch.device, group: dist.ProcessGroup | None,
          lr: float = 1e-4, compile_mode: str | None = None) -> Run:
    """``variant`` on this rank, over a fresh model whose blocks are compiled in ``compile_mode`` (None: eager)."""
    torch.manual_seed(0)
    with device:
        model = TransformerLM(config)
    if compile_mode is not None:
        model.compile_blocks(mode=compile_mode)
        # The blocks compile on their first call, inside torch DDP's forward for torch_ddp; dynamo's
        # DDPOptimizer, made for a whole model compiled under DDP, would then cut every block's graph
        # at DDP's bucket boundaries (torch_ddp: 134-144 ms a step with it, 101 ms without, xl on two
        # H200s under reduce-overhead). Blocks compiled whole are torch DDP's best case: the baseline.
        torch._dynamo.config.optimize_ddp = False
    adamw = dict(lr=lr, fused=device.type == "cuda")
    comm = dict(process_group=group, grad_comm_dtype=torch.bfloat16 if variant.bf16_comm else None)
    base = variant.base
    if base in ("single", "no_comm"):
        return Run(model, torch.optim.AdamW(model.parameters(), **adamw))
    if base in ("torch_ddp", "torch_ddp_view", "torch_zero"):
        wrapped = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                          gradient_as_bucket_view=base.endswith("view"), process_group=group)
        if variant.bf16_comm:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

            wrapped.register_comm_hook(group, bf16_compress_hook)
        if variant.local:
            wrapped.register_comm_hook(None, _no_communication_hook)
        if base == "torch_zero":
            return Run(wrapped, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **adamw))
        return Run(wrapped, torch.optim.AdamW(model.parameters(), **adamw))
    launching = dict(launch_thread=variant.launch_thread)
    bucketing = dict(allreduce="copy_engine" if variant.copy_engine else "process_group", **comm, **launching)
    if base in ("zero1", "zero1_broadcast"):
        container = DDPBucketed(model, bucket_size_mb=25, **bucketing)
        exchange = "broadcast" if base.endswith("broadcast") else "p2p"
        stages = {} if variant.exchange_stages is None else {"exchange_stages": variant.exchange_stages}
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, exchange=exchange, process_group=group,
                                     **stages, **adamw)
        return Run(container, optimizer, container.finish_gradient_synchronization, [container.remove_hooks])
    containers: dict[str, Callable[[], DataParallelModule]] = {
        "naive": lambda: NaiveDDP(model, **comm),
        "naive_flat": lambda: NaiveDDP(model, flat=True, **comm),
        "overlap": lambda: DDPIndividualParameters(model, **comm, **launching),
    }
    if base.startswith("bucketed_"):
        container = DDPBucketed(model, bucket_size_mb=float(base.split("_", 1)[1]), **bucketing)
    else:
        container = containers[base]()
    if variant.local:
        container._averager = _SendNothing()  # after construction: the start-up broadcast still ran
    if variant.step_stages is not None:  # the step finishes the synchronisation itself
        optimizer = OverlappedStepOptimizer(model.parameters(), container, torch.optim.AdamW,
                                            stages=variant.step_stages, **adamw)
        return Run(container, optimizer, cleanup=[container.remove_hooks])
    return Run(container, torch.optim.AdamW(model.parameters(), **adamw), container.finish_gradient_synchronization,
               [container.remove_hooks])


class _Sent:
    """A collective that was never launched: nothing to wait for."""

    def wait(self) -> None:
        pass


class _SendNothing:
    """``+local``'s stand-in for a container's GradientAverager: launches no collective."""

    def start(self, tensor: torch.Tensor) -> _Sent:
        return _Sent()


def _no_communication_hook(state, bucket):  # unannotated: DDP compares annotations with the real types
    """``+local``'s torch DDP comm hook: the bucket (a ``dist.GradBucket``) as it is, no all-reduce."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    if isinstance(optimizer, ZeroRedundancyOptimizer):  # a ShardedOptimizer's state is its shard already
        optimizer = optimizer.optim
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


@contextmanager
def sm_carveout(sms: int | None) -> Iterator[None]:
    """Matmuls inside run through cuBLASLt, which is told to leave ``sms`` SMs free (None: no change)."""
    if sms is None:
        yield
        return
    backend, carveout = torch.backends.cuda.preferred_blas_library(), torch._C._get_sm_carveout_experimental()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    torch._C._set_sm_carveout_experimental(sms)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(carveout)
        torch.backends.cuda.preferred_blas_library(backend)


def make_step(run: Run, variant: Variant, args: argparse.Namespace,
              device: torch.device) -> Callable[..., None]:
    """One training step of ``run``: ``step(batch, phases=None, host_marks=None)``; with ``phases`` (a dict
    of lists) the device is synchronised between forward, backward, gradient sync and optimizer and each
    is timed; ``host_marks`` (a list) gets the host's clock at the start and after forward, backward,
    the gradient sync and the optimizer return, with no synchronisation."""
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.precision == "bf16-mixed" else nullcontext()

    def step(batch: torch.Tensor, phases: dict[str, list[float]] | None = None,
             host_marks: list[float] | None = None) -> None:
        marks = [time.perf_counter()]
        if host_marks is not None:
            host_marks.append(marks[0])

        def mark() -> None:
            if phases is not None:
                synchronize(device)
                marks.append(time.perf_counter())
            if host_marks is not None:
                host_marks.append(time.perf_counter())

        run.optimizer.zero_grad(set_to_none=True)
        with autocast:
            logits = run.model(batch[:, :-1])  # (B, T, V)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        mark()
        with sm_carveout(variant.sm_carveout):
            loss.backward()
        mark()
        run.finish()
        mark()
        run.optimizer.step()
        mark()
        if phases is not None:
            for name, a, b in zip(("forward", "backward", "sync", "optimizer"), marks, marks[1:]):
                phases[name].append(b - a)

    return step


def for_each_warmed_variant(rank: int, args: argparse.Namespace, port: int,
                            visit: Callable[[str, Callable[..., None] | None, torch.device, torch.Tensor], None]) -> None:
    """A profiling bench's whole rank: join the group, then for each of ``args.variants`` in turn build it on
    this rank (``single`` on rank 0 alone), run ``args.warmup`` steps on this rank's batch, call
    ``visit(name, step, device, batch)`` (``step`` None where the variant does not run) and free it before the
    next is built; leave the group at the end, also after a failure."""
    device = init_rank(rank, args.nproc, port, "nccl" if args.device == "cuda" else "gloo", args.timeout_s)
    config, batch = rank_config_and_batch(args, rank, device)
    try:
        for name in args.variants:
            variant = Variant.parse(name)
            here = variant.base != "single" or rank == 0
            run = build(variant, config, device, None, compile_mode=args.compile) if here else None
            step = make_step(run, variant, args, device) if here else None
            for _ in range(args.warmup if here else 0):
                step(batch)
            visit(name, step, device, batch)
            runs, step, run = [run], None, None
            release(runs, device, args.compile)
    finally:
        dist.destroy_process_group()


def add_warmed_variant_args(parser: argparse.ArgumentParser, default: list[str], warmup_help: str) -> None:
    """The ``--variants`` and ``--warmup`` flags that ``for_each_warmed_variant`` reads."""
    parser.add_argument("--variants", type=variant_names, default=default,
                        help="comma-separated bench.ddp variant names, e.g. single,bucketed_25+thread")
    parser.add_argument("--warmup", type=int, default=3, help=warmup_help)


def release(runs: list[Run | None], device: torch.device, compile_mode: str | None) -> None:
    """Detach the runs' containers (their cleanups) and give their memory back; the caller drops its references."""
    for run in runs:
        for cleanup in run.cleanup if run is not None else []:
            cleanup()
    runs.clear()
    free_device_memory(device, compile_mode)


def free_device_memory(device: torch.device, compile_mode: str | None) -> None:
    """Give back what freed runs held. Under ``--compile reduce-overhead`` that takes dropping the compiled
    code too: its CUDA graphs' memory pools belong to torch's global cudagraph trees, not to the models, and
    piled up to an OOM by the tenth xl visit; shutting the trees down alone leaves the compiled blocks calling
    into them ("Running CUDAGraph after shutdown"), so the next model compiles afresh (from inductor's cache)."""
    if compile_mode == "reduce-overhead":
        torch._dynamo.reset()  # also resets the cudagraph trees
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(run: Run, variant: Variant, batches: list[torch.Tensor], args: argparse.Namespace,
            device: torch.device) -> dict:
    """Warm-up, timed steps (synchronised per step) and instrumented steps on this rank."""
    step = make_step(run, variant, args, device)
    for i in range(args.warmup):
        step(batches[i % len(batches)])
    step_times = []
    for i in range(args.steps):
        synchronize(device)
        start = time.perf_counter()
        step(batches[i % len(batches)])
        synchronize(device)
        step_times.append(time.perf_counter() - start)
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "sync": [], "optimizer": []}
    for i in range(args.instrumented_steps):
        synchronize(device)
        step(batches[i % len(batches)], phases)
    timeline = profile_kernels(lambda: step(batches[0])) if args.profile else {}
    params = [p for p in run.optimizer.param_groups[0]["params"]]
    checksum = torch.stack([p.detach().double().sum() for p in params]).sum().item()
    return {
        "timeline": timeline,
        "step_s": statistics.median(step_times),
        **{f"{k}_s": statistics.median(v) if v else float("nan") for k, v in phases.items()},
        "peak_mem": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else float("nan"),
        "opt_state": optimizer_state_bytes(run.optimizer),
        "checksum": checksum,
    }


def visit(name: str, attention: str, args: argparse.Namespace, device: torch.device,
          groups: dict[tuple, dist.ProcessGroup | None]) -> dict | None:
    """Build, measure and free one variant; rank 0 returns the row (slowest rank's time, largest memory,
    rank 0's kernel timeline), or None when it failed (the error is printed). ``groups`` caches the
    communication groups variants ask for (created on every rank, in the same order)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    config = ModelConfig.from_name(args.size, context_length=args.context_length, attention=attention,
                                   vocab_size=args.vocab_size)
    variant = Variant.parse(name)
    if variant.group_key is not None and variant.group_key not in groups:
        groups[variant.group_key] = gradient_process_group(*variant.group_key)
    group = groups.get(variant.group_key)
    runs_here = variant.base != "single" or rank == 0
    result = None
    if runs_here:
        free_device_memory(device, args.compile)
        held_before = 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            held_before = torch.cuda.memory_allocated(device)
        try:
            run = build(variant, config, device, group, compile_mode=args.compile)
            g = torch.Generator(device=device).manual_seed(1000 + rank)
            batches = [torch.randint(0, config.vocab_size, (args.batch_size, args.context_length + 1),
                                     device=device, generator=g) for _ in range(2)]
            result = measure(run, variant, batches, args, device)
            # What an earlier visit left allocated (torch DDP on a process group of our own was seen to hold
            # ~8 GB past its visit) is not this variant's: count the peak above the start.
            result["peak_mem"] -= held_before
            result["held_before"] = held_before
            for cleanup in run.cleanup:
                cleanup()
        except Exception as error:  # e.g. a kernel that fails to compile: every rank fails alike, and goes on
            traceback.print_exc()
            result = {"error": f"{type(error).__name__}: {error}"}
        run = batches = None
    per_rank = [None] * world
    dist.all_gather_object(per_rank, result)
    if rank != 0:
        return None
    ranks = [r for r in per_rank if r is not None]
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        print(f"{name} with {attention} attention failed: {errors[0]}", flush=True)
        return None
    nproc = 1 if variant.base == "single" else world
    step_s = max(r["step_s"] for r in ranks)
    row = {
        "variant": name, "attention": attention, "nproc": nproc, "step_ms": step_s * 1e3,
        **{f"{k}_ms": max(r[f"{k}_s"] for r in ranks) * 1e3 for k in ("forward", "backward", "sync", "optimizer")},
        "tokens_per_s": nproc * args.batch_size * args.context_length / step_s,
        "peak_mem_GB": max(r["peak_mem"] for r in ranks) / GB,
        "held_before_GB": max(r["held_before"] for r in ranks) / GB,
        "opt_state_GB": max(r["opt_state"] for r in ranks) / GB,
        "replicas_equal": len({r["checksum"] for r in ranks}) == 1,
        **ranks[0]["timeline"],
    }
    return row


def summarize(rows: list[dict], baseline: str = "torch_ddp") -> list[dict]:
    """Median over rounds per (variant, attention); ratios and scaling efficiency taken within each round."""
    summary = []
    for key in dict.fromkeys((r["variant"], r["attention"]) for r in rows):
        mine = [r for r in rows if (r["variant"], r["attention"]) == key]
        out = {k: mine[0][k] for k in ("variant", "attention", "nproc")}
        for k in ("step_ms", "forward_ms", "backward_ms", "sync_ms", "optimizer_ms", "tokens_per_s", "peak_mem_GB",
                  "opt_state_GB", *TIMELINE_COLUMNS):
            values = [r[k] for r in mine if k in r]
            if values:
                out[k] = statistics.median(values)
        same_round = {(r["round"], r["variant"], r["attention"]): r["step_ms"] for r in rows}
        for name, other in ((f"vs_{baseline}", baseline), ("scaling_eff", "single")):
            ratios = [same_round[(r["round"], other, r["attention"])] for r in mine
                      if (r["round"], other, r["attention"]) in same_round]
            ratios = [r["step_ms"] / o if name.startswith("vs") else o / r["step_ms"] for r, o in zip(mine, ratios)]
            out[name] = statistics.median(ratios) if ratios else float("nan")
        out["replicas_equal"] = all(r["replicas_equal"] for r in mine)
        out["rounds"] = len(mine)
        summary.append(out)
    return summary


def zero1_memory_notes(summary: list[dict], nproc: int) -> str:
    """Peak-memory saving of each ZeRO variant against its DDP counterpart, and the issue's target."""
    by_name = {r["variant"]: r for r in summary if r["attention"] == summary[0]["attention"]}
    lines = []
    for zero, ddp in (("zero1", "bucketed_25"), ("zero1_broadcast", "bucketed_25"), ("torch_zero", "torch_ddp")):
        if zero in by_name and ddp in by_name:
            full_state = by_name[ddp]["opt_state_GB"]
            saved = by_name[ddp]["peak_mem_GB"] - by_name[zero]["peak_mem_GB"]
            target = 0.9 * (1 - 1 / nproc) * full_state
            lines.append(f"- {zero} vs {ddp}: peak memory {saved:.2f} GB lower per rank; target ≥ 0.9·(1−1/N)·"
                         f"{full_state:.2f} GB optimizer state = {target:.2f} GB ({'met' if saved >= target else 'missed'}); "
                         f"step time ×{by_name[zero]['step_ms'] / by_name[ddp]['step_ms']:.3f}")
    return "\n".join(lines)


def _bar_plot(summary: list[dict], value: str, label: str, title: str, group_by_attention: bool):
    def plot(path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 0.35 * len(summary) + 1.5))
        names = [f"{r['attention']} / {r['variant']}" if group_by_attention else r["variant"] for r in summary]
        ax.barh(names, [r[value] for r in summary], color="tab:blue")
        ax.invert_yaxis()
        ax.set(xlabel=label, title=title)
        for i, r in enumerate(summary):
            ax.text(r[value], i, f" {r[value]:.4g}", va="center", fontsize=8)
        ax.grid(True, axis="x", alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)

    return plot


def _agree(value: bool) -> bool:
    """Rank 0's decision, on every rank."""
    decision = [value]
    dist.broadcast_object_list(decision, src=0)
    return decision[0]


def _worker(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    """Rank 0 sends each row as soon as it is measured, so a later failure still leaves the earlier ones."""
    device = init_rank(rank, args.nproc, port, "nccl" if args.device == "cuda" else "gloo", args.timeout_s)
    start = time.perf_counter()
    # Round 0, then the matrix, then the repeat rounds: a time budget cuts repeats before whole tables.
    rounds = [[(r, v, args.attention) for v in args.variants] for r in range(args.rounds)]
    matrix = [("matrix", v, a) for a in args.matrix_attention for v in MATRIX_STRATEGIES]
    plan = rounds[0] + matrix + [visit for later in rounds[1:] for visit in later]
    groups: dict[tuple, dist.ProcessGroup | None] = {}
    try:
        for round_, variant, attention in plan:
            if not _agree(time.perf_counter() - start < args.time_budget_s):
                break
            row = visit(variant, attention, args, device, groups)
            if row is not None:
                queue.put({"round": round_, **row})
                print(f"[{time.perf_counter() - start:6.1f}s] round {round_} {attention:>12} {variant:>16}: "
                      f"{row['step_ms']:8.2f} ms  sync {row['sync_ms']:7.2f} ms  {row['peak_mem_GB']:6.2f} GB", flush=True)
    finally:
        for group in groups.values():
            if group is not None:
                dist.destroy_process_group(group)
        dist.destroy_process_group()


def add_setup_args(parser: argparse.ArgumentParser) -> None:
    """The model, batch, precision and process flags every data-parallel benchmark shares."""
    parser.add_argument("--size", default="xl", help="model size (tiny, small, medium, large, xl, 2.7b)")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--context-length", type=int, default=512)
    parser.add_argument("--vocab-size", type=int, default=None, help="default: the size's (10,000)")
    parser.add_argument("--precision", choices=["bf16-mixed", "32-true"], default="bf16-mixed")
    parser.add_argument("--nproc", type=int, default=None, help="processes, one per GPU (default: all GPUs, or 2 on CPU)")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--attention", default="sdpa", help="the model's attention (the variant table's, for bench.ddp)")
    parser.add_argument("--compile", nargs="?", const="default", choices=COMPILE_MODES, default=None,
                        help="torch.compile each Transformer block of every variant's model, in this torch.compile "
                             "mode (default: 'default'; 'reduce-overhead' replays each block's kernels as CUDA "
                             "graphs); compiling happens in warm-up")
    parser.add_argument("--timeout-s", type=int, default=600, help="process-group timeout")
    add_out_dir_arg(parser)


def rank_config_and_batch(args: argparse.Namespace, rank: int, device: torch.device) -> tuple[ModelConfig, torch.Tensor]:
    """The model config the setup flags describe, and this rank's own batch of random tokens (B, T + 1)."""
    config = ModelConfig.from_name(args.size, context_length=args.context_length, attention=args.attention,
                                   vocab_size=args.vocab_size)
    g = torch.Generator(device=device).manual_seed(1000 + rank)
    batch = torch.randint(0, config.vocab_size, (args.batch_size, args.context_length + 1), device=device, generator=g)
    return config, batch


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
        parser.error(f"unknown attention {args.attention!r}; registered: {', '.join(attention_names())}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_setup_args(parser)
    parser.add_argument("--variants", type=variant_names, default=DEFAULT_VARIANTS,
                        help="comma-separated; bucketed_<MB> for any bucket size; options after '+': "
                             f"{VARIANT_OPTIONS} (see above)")
    parser.add_argument("--profile", action="store_true",
                        help="profile one extra step per visit: NCCL time, share hidden under compute, GPU idle")
    parser.add_argument("--matrix", action="store_true",
                        help="add attention × (single, naive, bucketed_25, torch_ddp)")
    parser.add_argument("--matrix-attention", type=lambda s: s.split(","), default=None,
                        help="attentions for --matrix (default: sdpa and flash_triton when registered)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds over the variants")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per visit")
    parser.add_argument("--instrumented-steps", type=int, default=2, help="steps timed phase by phase")
    parser.add_argument("--time-budget-s", type=float, default=float("inf"), help="start no visit after this")
    args = parser.parse_args(argv)
    check_setup_args(parser, args)
    for name in args.matrix_attention or []:
        if name not in attention_names():
            parser.error(f"unknown attention {name!r}; registered: {', '.join(attention_names())}")
    if args.matrix_attention is None:
        args.matrix_attention = [a for a in ("sdpa", "flash_triton") if a in attention_names()] if args.matrix else []
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    return spawn_ranks(_worker, args, args.nproc, lambda rows: write_tables(rows, args))


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


def write_tables(rows: list[dict], args: argparse.Namespace) -> None:
    """The summary (+ per-round rows and plot) of the variant table, and the attention matrix."""
    stem = f"ddp_{run_label(args)}"
    setup = f"{setup_description(args)}, {'fused ' if args.device == 'cuda' else ''}AdamW, {args.nproc} processes"
    method = ("Plain PyTorch loop, processes started by torch.multiprocessing.spawn (no torchrun, no Trainer); "
              f"variants interleaved over {args.rounds} rounds, a fresh model per visit; {args.warmup} warm-up, "
              f"{args.steps} timed steps (median, slowest rank), {args.instrumented_steps} phase-instrumented steps. "
              "sync_ms: gradient averaging left after backward (torch DDP waits inside backward, so 0 there). "
              "scaling_eff: single-rank step time / step time. vs_torch_ddp: step-time ratio in the same round. "
              "peak_mem_GB: the visit's peak allocation above what was allocated when it started "
              "(held_before_GB in the per-round file).")
    columns = ["variant", "attention", "nproc", "step_ms", "vs_torch_ddp", "scaling_eff", "tokens_per_s", "forward_ms",
               "backward_ms", "sync_ms", "optimizer_ms", *(TIMELINE_COLUMNS if args.profile else []), "peak_mem_GB",
               "opt_state_GB", "replicas_equal", "rounds"]
    main_rows = [r for r in rows if r["round"] != "matrix"]
    if main_rows:
        summary = summarize(main_rows)
        write_results(f"{stem}_rounds", main_rows, title=f"Data-parallel step times per round: {setup}", notes=method,
                      out_dir=args.out_dir)
        write_results(stem, summary, title=f"Data-parallel strategies: {setup}",
                      notes=method + "\n\n" + zero1_memory_notes(summary, args.nproc), columns=columns,
                      plot=_bar_plot(summary, "step_ms", "step time (ms)", setup, False), out_dir=args.out_dir)
    matrix_rows = [r for r in rows if r["round"] == "matrix"]
    if matrix_rows:
        for r in matrix_rows:
            r["round"] = 0
        matrix = summarize(matrix_rows)
        write_results(f"ddp_attention_{args.size}_{args.nproc}{'gpu' if args.device == 'cuda' else 'cpu'}", matrix,
                      title=f"Attention × data-parallel strategy: {setup}", notes=method, columns=columns,
                      plot=_bar_plot(matrix, "tokens_per_s", "tokens/s (all ranks)", setup, True), out_dir=args.out_dir)


if __name__ == "__main__":
    main()
