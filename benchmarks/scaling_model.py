"""A scaling model on paper: ``python -m benchmarks.scaling_model`` prints its check against the four-GPU rows it
did not use, then its predictions of step time and memory per GPU for xl, 2.7b and an 8B model on 8, 64 and 512
GPUs under bucketed_ddp, zero1 and zero3 (compiled, bf16-mixed, context 1024 × batch 8 per GPU, AdamW).

A step on N GPUs is one GPU's step (measured; the 8B's from the 2.7b's FLOP rate), less the optimizer work a
strategy shards, plus (a) backward's kernels slowed beside NCCL, a fraction of the step calibrated on two GPUs,
(b) the communication no compute hides: the collective after backward ends, whatever outlasts the compute it runs
beside, and zero1's parameter exchange. Collectives cost a fixed time each plus their bus bytes over the bus
bandwidth (nccl-tests' convention): NVLink within a host, fit to the measured NCCL all-reduce; across hosts the
NICs of a host's 8 GPUs, 400 Gb/s each. Memory per GPU is the fp32 weights, gradients and AdamW moments each
strategy keeps whole or as a 1/N shard, plus activations from one GPU's measured peak. docs/scaling_model.md reads
the output; which inputs were measured where is said beside each constant below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cache

import torch

from lm_systems.model.config import ModelConfig
from lm_systems.model.transformer import TransformerLM
from lm_systems.parallel.bucketed import ACROSS_HOSTS_BUCKET_MB, ONE_HOST_BUCKET_MB, gradient_buckets

GIB = 2**30
TOKENS = 1024 * 8  # per GPU per step
STRATEGIES = ("bucketed_ddp", "zero1", "zero3")

# -- measured on one GPU (H100, compiled, 1024 × 8, bf16-mixed): step ms and peak GiB
# xl: benchmarks/results/scaling_xl_2gpu.md, 2026-11-26 evening, call 2. 2.7b: the one-GPU row of issue 50's
# four-H100 lease (a previous session's measurement, quoted in the issue; the only one-GPU 2.7b step at this shape).
ONE_GPU = {"xl": (245.0, 55.8), "2.7b": (364.4, 75.5)}
EIGHT_B = ModelConfig(d_model=4096, d_ff=11008, num_layers=34, num_heads=32, vocab_size=151936, context_length=1024)

# -- calibrated on two GPUs (H100s, NVLink), benchmarks/results/scaling_xl_2gpu.md
# Traced compiled xl (2026-11-27 12:51): GPU compute 230.3 ms alone, 243.1 and 245.8 beside bucketed_ddp's NCCL.
SLOWDOWN_REPLICATED = (244.45 - 230.3) / 230.3
# fused AdamW, memory-bound: xl's ~18 ms (docs/findings/data_parallel_scaling.md: zero1's half is ~9 ms), per parameter
ADAMW_MS_PER_PARAM = 18.0 / 1.998e9
EXCHANGE_STAGES = 4  # zero1's default: the sharded update pipelined with the exchange of updated parameters
# zero3's slowdown is fit so that the model gives its two-GPU step on xl (2026-11-26 evening, call 2, whose one-GPU
# step is ONE_GPU's 245.0).
ZERO3_TWO_GPU_MS = 257.4

# -- NCCL on NVLink: all-reduce time = LATENCY + bus factor × bytes / BUS, fit to measured points
# 2 ranks: benchmarks/results/comm_nccl_2proc.md (H200s; 100 MB 0.417 ms, 1000 MB 3.18 ms). 4 ranks: issue 50's
# `benchmarks.comm --nproc 4` on four H100s (a previous session's measurement: 173 / 277 / 346 GB/s at 25 / 100 /
# 1000 MB), the fit within 4% at each.
HOST_BUS_GBPS = {2: 325.0, 4: 356.0}
LATENCY_MS = 0.12
# -- assumed, not measured here
GPUS_PER_HOST = 8  # for 8 GPUs and more: HGX hosts; within one, the four-rank bus bandwidth
NIC_GBPS = 50.0  # 400 Gb/s per GPU
NIC_EFFICIENCY = 0.8  # of the line rate a ring reaches across hosts
HOP_LATENCY_MS = 0.01  # per level of NCCL's tree across hosts
BACKWARD_SHARE = 2 / 3  # of forward + backward: the time gradient collectives can hide under
FORWARD_SHARE = 1 / 3
MEMORY_GIB = 79.0  # what torch sees of an 80 GB H100


@dataclass(frozen=True)
class Shape:
    """A model as the model needs it: parameters, the gradient buckets' bytes, and one GPU's step and peak."""

    name: str
    params: int
    layers: int
    step_1gpu_ms: float  # forward, backward and AdamW on one GPU
    activations_gib: float  # one GPU's peak less its fp32 weights, gradients and moments
    bucket_mb: dict[float, tuple[float, ...]]  # bucket cap → each bucket's MB, in launch order

    def at_batch(self, share: float) -> Shape:
        """The same model at ``share`` × 1024 × 8 tokens per GPU: forward, backward and activations scale with it."""
        step = self.adamw_ms + share * self.forward_backward_ms
        return replace(self, step_1gpu_ms=step, activations_gib=share * self.activations_gib)

    @property
    def adamw_ms(self) -> float:
        return ADAMW_MS_PER_PARAM * self.params

    @property
    def forward_backward_ms(self) -> float:
        return self.step_1gpu_ms - self.adamw_ms


def _meta_model(config: ModelConfig) -> TransformerLM:
    with torch.device("meta"):
        return TransformerLM(config)


@cache
def shape(name: str) -> Shape:
    """xl and 2.7b from their measured one-GPU steps; "8b" from the 2.7b's forward and backward FLOP rate, its own
    AdamW, and the measured activations per layer, d_model and token (the 8B does not fit one GPU at this batch: its
    one-GPU step is a quantity of the model)."""
    config = EIGHT_B if name == "8b" else ModelConfig.from_name(name, context_length=1024)
    model = _meta_model(config)
    params = model.num_parameters()
    if name in ONE_GPU:
        step, peak = ONE_GPU[name]
        activations = peak - 16 * params / GIB
    else:
        reference = _meta_model(ModelConfig.from_name("2.7b", context_length=1024))
        reference_compute = ONE_GPU["2.7b"][0] - ADAMW_MS_PER_PARAM * reference.num_parameters()
        flops_per_ms = TOKENS * reference.flops_per_token() / reference_compute
        step = TOKENS * model.flops_per_token() / flops_per_ms + ADAMW_MS_PER_PARAM * params
        activations = _activation_bytes_per_layer_width_token() * config.num_layers * config.d_model * TOKENS / GIB
    buckets = {
        cap: tuple(sum(p.numel() * 4 for p in b) / 2**20 for b in gradient_buckets(model, cap))
        for cap in (ONE_HOST_BUCKET_MB, ACROSS_HOSTS_BUCKET_MB)
    }
    return Shape(name, params, config.num_layers, step, activations, buckets)


def _activation_bytes_per_layer_width_token() -> float:
    """The measured models' activation bytes per layer, d_model and token, averaged."""
    per = [
        shape(n).activations_gib * GIB / (c.num_layers * c.d_model * TOKENS)
        for n, c in ((n, ModelConfig.from_name(n)) for n in ONE_GPU)
    ]
    return sum(per) / len(per)


def hosts(n: int) -> int:
    return 1 if n <= GPUS_PER_HOST else math.ceil(n / GPUS_PER_HOST)


@dataclass(frozen=True)
class Cluster:
    """What carries collectives across hosts: the NICs of a host a ring crosses it through (NCCL's rings, one per
    GPU and its NIC, use all 8 at once on a rail-optimised fabric), and the gradient bucket cap (None: the
    strategies' default by hosts, lm_systems.parallel.default_bucket_size_mb)."""

    nics: int = GPUS_PER_HOST
    bucket_mb: float | None = None

    def bus_gbps(self, n: int) -> float:
        """Bus bandwidth over n GPUs: NVLink within a host; across hosts, each ring crosses a host once, so the bus
        bandwidth is that of the NICs it crosses through, or NVLink's if lower."""
        nvlink = HOST_BUS_GBPS.get(n, HOST_BUS_GBPS[4])
        return nvlink if hosts(n) == 1 else min(nvlink, self.nics * NIC_GBPS * NIC_EFFICIENCY)

    def collective_ms(self, nbytes: float, n: int, all_reduce: bool) -> float:
        """One all-reduce (bus factor 2(n-1)/n) or reduce-scatter / all-gather ((n-1)/n) of ``nbytes`` over n GPUs."""
        factor = (2 if all_reduce else 1) * (n - 1) / n
        latency = LATENCY_MS + 2 * math.log2(hosts(n)) * HOP_LATENCY_MS
        return latency + factor * nbytes / (self.bus_gbps(n) * 1e9) * 1e3

    def bucket_cap(self, n: int) -> float:
        if self.bucket_mb is not None:
            return self.bucket_mb
        return ACROSS_HOSTS_BUCKET_MB if hosts(n) > 1 else ONE_HOST_BUCKET_MB


RAIL = Cluster()
ONE_NIC = Cluster(nics=1)


def gradient_sync_exposed_ms(model: Shape, n: int, all_reduce: bool, cluster: Cluster) -> float:
    """The last bucket's collective (it starts as backward ends) and whatever the others outlast backward by."""
    times = [cluster.collective_ms(mb * 2**20, n, all_reduce) for mb in model.bucket_mb[cluster.bucket_cap(n)]]
    return times[-1] + max(0.0, sum(times[:-1]) - BACKWARD_SHARE * model.forward_backward_ms)


def _zero3_exposed_ms(model: Shape, n: int, cluster: Cluster) -> float:
    """The first unit's gather and the last unit's reduce-scatter, plus, in every unit (a block), the bf16 gather
    (forward) and gather and reduce-scatter (backward) that outlast its compute."""
    gather = cluster.collective_ms(2 * model.params / model.layers, n, all_reduce=False)
    forward, backward = (share * model.forward_backward_ms / model.layers for share in (FORWARD_SHARE, BACKWARD_SHARE))
    return 2 * gather + model.layers * (max(0.0, gather - forward) + max(0.0, 2 * gather - backward))


def _zero3_slowdown() -> float:
    """Fit to zero3's two-GPU step on xl: what is left of it after the compute, its sharded AdamW and the exposed
    collectives, as a fraction of the compute."""
    xl = shape("xl")
    rest = ZERO3_TWO_GPU_MS - xl.forward_backward_ms - xl.adamw_ms / 2 - _zero3_exposed_ms(xl, 2, RAIL)
    return rest / xl.forward_backward_ms


def step_ms(model: Shape, strategy: str, n: int, cluster: Cluster = RAIL) -> float:
    """Predicted step on n GPUs (1: the one-GPU step)."""
    if n == 1:
        return model.step_1gpu_ms
    compute = model.forward_backward_ms
    if strategy == "zero3":
        return compute * (1 + _zero3_slowdown()) + model.adamw_ms / n + _zero3_exposed_ms(model, n, cluster)
    slowed = compute + SLOWDOWN_REPLICATED * model.step_1gpu_ms
    if strategy == "bucketed_ddp":
        return slowed + gradient_sync_exposed_ms(model, n, True, cluster) + model.adamw_ms
    # zero1: gradients reduced to their owners (reduce-scatter bytes), the owner steps its 1/n, then the updated fp32
    # parameters go to the others in stages, each sent while the next is updated.
    exchange, update = cluster.collective_ms(4 * model.params, n, all_reduce=False), model.adamw_ms / n
    after_backward = max(exchange, update) + min(exchange, update) / EXCHANGE_STAGES
    return slowed + gradient_sync_exposed_ms(model, n, False, cluster) + after_backward


def memory_gib(model: Shape, strategy: str, n: int) -> float:
    """Peak per GPU: fp32 weights (4 B), gradients (4 B) and AdamW moments (8 B) whole or sharded, plus activations;
    zero3 adds two gathered bf16 units (the one computing and the one prefetched)."""
    whole, shard = {"bucketed_ddp": (16, 0), "zero1": (8, 8), "zero3": (0, 16)}[strategy]
    gathered = 2 * 2 * model.params / model.layers if strategy == "zero3" else 0
    return (whole * model.params + shard * model.params / n + gathered) / GIB + model.activations_gib


# -- the four-GPU rows the model did not use: issue 50's table, measured on four H100s by a previous session
FOUR_GPU_LEASE_ONE_GPU_MS = {"xl": (245.0 + 245.5) / 2, "2.7b": 364.4}  # the same lease's one-GPU steps
FOUR_GPU_MEASURED = {  # (model, strategy): (step ms, peak GiB per rank)
    ("xl", "bucketed_ddp"): (266.8, 55.0),
    ("xl", "zero1"): (263.1, 43.8),
    ("xl", "zero3"): (245.2, 33.3),
    ("2.7b", "zero1"): (390.0, 55.7),
    ("2.7b", "zero3"): (355.7, 39.0),
}


def check_rows() -> list[dict]:
    rows = []
    for (name, strategy), (step, peak) in FOUR_GPU_MEASURED.items():
        model = shape(name)
        predicted, predicted_peak = step_ms(model, strategy, 4), memory_gib(model, strategy, 4)
        rows.append(
            {
                "model": name,
                "strategy": strategy,
                "measured_ms": step,
                "predicted_ms": predicted,
                "step_error": predicted / step - 1,
                "measured_scaling": FOUR_GPU_LEASE_ONE_GPU_MS[name] / step,
                "predicted_scaling": model.step_1gpu_ms / predicted,
                "measured_gib": peak,
                "predicted_gib": predicted_peak,
                "memory_error": predicted_peak / peak - 1,
            }
        )
    return rows


def prediction_rows(
    gpus: tuple[int, ...] = (8, 64, 512), cluster: Cluster = RAIL, global_tokens: int | None = None
) -> list[dict]:
    """Each model × strategy × GPU count at 1024 × 8 tokens per GPU, or at ``global_tokens`` a step shared by the
    GPUs. ``scaling``: one GPU's step at the same tokens per GPU over this one; ``speedup``: tokens per second over
    the first count's."""
    rows = []
    for name in ("xl", "2.7b", "8b"):
        for strategy in STRATEGIES:
            for n in gpus:
                model = shape(name).at_batch(global_tokens / n / TOKENS) if global_tokens else shape(name)
                step, peak = step_ms(model, strategy, n, cluster), memory_gib(model, strategy, n)
                tokens_per_ms = (global_tokens or n * TOKENS) / step
                if n == gpus[0]:
                    first = tokens_per_ms
                rows.append(
                    {
                        "model": name,
                        "strategy": strategy,
                        "gpus": n,
                        "step_ms": step,
                        "scaling": model.step_1gpu_ms / step,
                        "speedup": tokens_per_ms / first,
                        "gib": peak,
                        "fits": peak <= MEMORY_GIB,
                    }
                )
    return rows


def _print_predictions(title: str, **options) -> None:
    print(f"\npredicted: compiled, bf16-mixed, 8 GPUs a host; {title}")
    print(
        "| model | strategy | GPUs | step ms | scaling | speed-up over the first count | GiB per GPU |\n"
        "|---|---|---|---|---|---|---|"
    )
    for r in prediction_rows(**options):
        memory = f"{r['gib']:.1f}" + ("" if r["fits"] else f" (> {MEMORY_GIB:g}: does not fit)")
        print(
            f"| {r['model']} | `{r['strategy']}` | {r['gpus']} | {r['step_ms']:.1f} | {r['scaling']:.1%} "
            f"| {r['speedup']:.1f}× | {memory} |"
        )


def main() -> None:
    print(
        "one-GPU steps (ms): "
        + ", ".join(f"{n} {shape(n).step_1gpu_ms:.1f}" for n in ("xl", "2.7b", "8b"))
        + f"; slowdown beside NCCL: replicated {SLOWDOWN_REPLICATED:.3f}, zero3 {_zero3_slowdown():.3f} (fit)"
    )
    print("\ncheck: four H100s, rows not used (predicted / measured − 1)")
    print(
        "| model | strategy | step ms measured | predicted | error | scaling measured | predicted "
        "| GiB measured | predicted | error |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    for r in check_rows():
        print(
            f"| {r['model']} | `{r['strategy']}` | {r['measured_ms']:.1f} | {r['predicted_ms']:.1f} | "
            f"{r['step_error']:+.1%} | {r['measured_scaling']:.1%} | {r['predicted_scaling']:.1%} | "
            f"{r['measured_gib']:.1f} | {r['predicted_gib']:.1f} | {r['memory_error']:+.1%} |"
        )
    _print_predictions("1024 × 8 per GPU; rings across hosts through all 8 NICs")
    _print_predictions("the same through one NIC a host", cluster=ONE_NIC)
    global_batch = {"global_tokens": 128 * TOKENS, "gpus": (128, 512)}
    _print_predictions("1M tokens a step (1024 × 8 on each of 128 GPUs); 8 NICs", **global_batch)
    _print_predictions(
        "the same with 1000 MB buckets across hosts", cluster=Cluster(bucket_mb=ONE_HOST_BUCKET_MB), **global_batch
    )


if __name__ == "__main__":
    main()
