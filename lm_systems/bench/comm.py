"""All-reduce benchmark: ``python -m lm_systems.bench.comm --backend nccl --nproc 2``.

Spawns ``--nproc`` processes (torch.multiprocessing, no torchrun), one per GPU with NCCL or on the CPU
with gloo, and all-reduces float32 tensors of each size. Time is the median over ``--iters`` calls
of the slowest rank (every call starts after a barrier; on NCCL the device is synchronised before
and after it); bandwidths follow nccl-tests' convention:

    algorithm bandwidth = bytes / time
    bus bandwidth       = 2 (n - 1) / n · bytes / time   (what each link carries in a ring all-reduce)

With NCCL, ``--ops sum,avg`` also compares ReduceOp.AVG (what the DDP containers use on NCCL) with SUM,
and ``copy_engine`` adds DDPBucketed's other way to average: peer copies over symmetric memory
(lm_systems/parallel/peer_copy.py). ``--chunk-mb X`` all-reduces each tensor as consecutive chunks of at
most X MB launched back to back, then waits for all, as a bucketed DDP does with its buckets: at 25 MB it
shows what the per-collective cost does to the bandwidth a bucketed backward can get.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from lm_systems.bench.device import synchronize
from lm_systems.bench.ranks import init_rank, spawn_ranks
from lm_systems.bench.report import add_out_dir_arg, write_results
from lm_systems.parallel.peer_copy import CopyEngineAverager

MB = 1_000_000
REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG}
COPY_ENGINE = "copy_engine"  # DDPBucketed's peer-copy average (mean), beside NCCL's reduce ops
OPS = [*REDUCE_OPS, COPY_ENGINE]


def bus_bandwidth(nbytes: int, seconds: float, nproc: int) -> float:
    """Bytes per second each link carries in a ring all-reduce of ``nbytes`` over ``nproc`` ranks (nccl-tests)."""
    return 2 * (nproc - 1) / nproc * nbytes / seconds


def time_all_reduce(tensor: torch.Tensor, op: str, chunk_numel: int, warmup: int, iters: int) -> float:
    """Median seconds to all-reduce ``tensor`` in chunks of ``chunk_numel``, launched back to back, on this
    rank (ranks aligned by a barrier before each call)."""
    averager = None
    if op == COPY_ENGINE:
        averager = CopyEngineAverager()
        buffer = averager.allocate(tensor.numel(), tensor.dtype, tensor.device, min(chunk_numel, tensor.numel()))
        tensor = buffer.copy_(tensor)
    chunks = tensor.split(chunk_numel)
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        synchronize(tensor.device)
        start = time.perf_counter()
        if averager is None:
            works = [dist.all_reduce(chunk, op=REDUCE_OPS[op], async_op=True) for chunk in chunks]
        else:
            works = [averager.start(chunk) for chunk in chunks]
        for work in works:
            work.wait()
        synchronize(tensor.device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _worker(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    device = init_rank(rank, args.nproc, port, args.backend, args.timeout_s)
    try:
        for op_name in args.ops:
            for size_mb in args.sizes_mb:
                numel = int(size_mb * MB) // 4
                tensor = torch.randn(numel, device=device)
                chunk_numel = int(args.chunk_mb * MB) // 4 if args.chunk_mb else numel
                seconds = time_all_reduce(tensor, op_name, chunk_numel, args.warmup, args.iters)
                local = torch.tensor([seconds], device=device)
                dist.all_reduce(local, op=dist.ReduceOp.MAX)  # the collective is as slow as its slowest rank
                seconds = local.item()
                nbytes = numel * 4
                row = {
                    "backend": args.backend, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "nproc": args.nproc, "op": op_name, "size_mb": size_mb, "chunk_mb": args.chunk_mb or size_mb,
                    "time_ms": seconds * 1e3,
                    "algbw_GBps": nbytes / seconds / 1e9,
                    "busbw_GBps": bus_bandwidth(nbytes, seconds, args.nproc) / 1e9,
                }
                if rank == 0:
                    queue.put(row)
                del tensor
    finally:
        dist.destroy_process_group()


def _plot(rows: list[dict]):
    def plot(path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for op in dict.fromkeys(r["op"] for r in rows):
            mine = [r for r in rows if r["op"] == op]
            ax.plot([r["size_mb"] for r in mine], [r["busbw_GBps"] for r in mine], marker="o", label=op)
        ax.set(xscale="log", xlabel="tensor size (MB, float32)", ylabel="bus bandwidth (GB/s)",
               title=f"all-reduce, {rows[0]['backend']}, {rows[0]['nproc']} processes")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)

    return plot


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto",
                        help="auto: nccl when CUDA is available, else gloo (on the CPU)")
    parser.add_argument("--nproc", type=int, default=2, help="processes (with NCCL: at most the number of GPUs)")
    parser.add_argument("--sizes-mb", type=lambda s: [float(x) for x in s.split(",")], default=[1, 10, 100, 1000],
                        help="comma-separated tensor sizes in MB (10^6 bytes)")
    parser.add_argument("--ops", type=lambda s: s.split(","), default=None,
                        help="comma-separated among sum, avg, copy_engine (NCCL only; the default: sum; sum,avg on NCCL)")
    parser.add_argument("--chunk-mb", type=float, default=None,
                        help="all-reduce each tensor as chunks of at most this many MB, launched back to back")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--timeout-s", type=int, default=300, help="process-group timeout")
    add_out_dir_arg(parser)
    parser.add_argument("--name", default=None, help="result file stem (default comm_<backend>_<nproc>proc)")
    args = parser.parse_args(argv)
    if args.backend == "auto":
        args.backend = "nccl" if torch.cuda.is_available() else "gloo"
    if args.backend == "nccl" and args.nproc > torch.cuda.device_count():
        parser.error(f"--nproc {args.nproc} needs {args.nproc} GPUs for nccl; {torch.cuda.device_count()} visible")
    if args.nproc < 2:
        parser.error("--nproc must be at least 2 for an all-reduce to communicate")
    args.ops = args.ops or (["sum", "avg"] if args.backend == "nccl" else ["sum"])
    unknown = set(args.ops) - set(OPS)
    if unknown or (args.backend == "gloo" and {"avg", COPY_ENGINE} & set(args.ops)):
        parser.error(f"--ops must be among {OPS} (gloo has neither avg nor copy_engine), got {args.ops}")
    if args.chunk_mb is not None and args.chunk_mb <= 0:
        parser.error(f"--chunk-mb must be positive, got {args.chunk_mb}")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    return spawn_ranks(_worker, args, args.nproc, lambda rows: _write(rows, args))


def _write(rows: list[dict], args: argparse.Namespace) -> None:
    name = args.name or f"comm_{args.backend}_{args.nproc}proc"
    write_results(
        name, rows, title=f"All-reduce, {args.backend}, {args.nproc} processes, float32",
        notes="Median of the slowest rank over "
        f"{args.iters} calls after {args.warmup} warm-up calls; bus bandwidth = 2(n-1)/n · bytes / time.",
        columns=["backend", "device", "nproc", "op", "size_mb", "chunk_mb", "time_ms", "algbw_GBps", "busbw_GBps"],
        plot=_plot(rows), out_dir=args.out_dir,
    )


if __name__ == "__main__":
    main()
