"""All-reduce bandwidth: ``python -m benchmarks.comm --backend nccl --nproc 2``.

Spawns ``--nproc`` processes (torch.multiprocessing, no torchrun), one per GPU with NCCL or on the CPU
with gloo, and all-reduces float32 tensors of each size. Time is the median over ``--iters`` calls
of the slowest rank (every call starts after a barrier; on NCCL the device is synchronised before
and after it); bandwidths follow nccl-tests' convention:

    algorithm bandwidth = bytes / time
    bus bandwidth       = 2 (n - 1) / n · bytes / time   (what each link carries in a ring all-reduce)

On NCCL the table also times ReduceOp.AVG (what the DDP containers use on NCCL) beside SUM.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Iterator

import torch
import torch.distributed as dist

from benchmarks.device import timed
from benchmarks.ranks import spawn_ranks
from benchmarks.report import argument_parser, line_plot, write_results

MB = 1_000_000
REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG}


def bus_bandwidth(nbytes: int, seconds: float, nproc: int) -> float:
    """Bytes per second each link carries in a ring all-reduce of ``nbytes`` over ``nproc`` ranks (nccl-tests)."""
    return 2 * (nproc - 1) / nproc * nbytes / seconds


def time_all_reduce(tensor: torch.Tensor, op: str, warmup: int, iters: int) -> float:
    """Median seconds of an all-reduce of ``tensor`` on this rank, the ranks aligned by a barrier before each."""
    times = []
    for _ in range(warmup + iters):
        dist.barrier()
        times.append(timed(lambda: dist.all_reduce(tensor, op=REDUCE_OPS[op]), tensor.device))
    return statistics.median(times[warmup:])


def _rank(args: argparse.Namespace, device: torch.device) -> Iterator[dict]:
    for op in ("sum", "avg") if args.backend == "nccl" else ("sum",):  # gloo has no AVG
        for size_mb in args.sizes_mb:
            tensor = torch.randn(int(size_mb * MB) // 4, device=device)
            seconds = torch.tensor([time_all_reduce(tensor, op, args.warmup, args.iters)], device=device)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the collective is as slow as its slowest rank
            nbytes = tensor.numel() * 4
            yield {
                "backend": args.backend,
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "nproc": args.nproc,
                "op": op,
                "size_mb": size_mb,
                "time_ms": seconds.item() * 1e3,
                "algbw_GBps": nbytes / seconds.item() / 1e9,
                "busbw_GBps": bus_bandwidth(nbytes, seconds.item(), args.nproc) / 1e9,
            }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argument_parser(__doc__)
    parser.add_argument(
        "--backend",
        choices=["nccl", "gloo"],
        default="nccl" if torch.cuda.is_available() else "gloo",
        help="nccl (one GPU per process; the default where CUDA is available) or gloo (on the CPU)",
    )
    parser.add_argument("--nproc", type=int, default=2, help="processes (with NCCL: at most the number of GPUs)")
    parser.add_argument(
        "--sizes-mb",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[1, 10, 100, 1000],
        help="comma-separated tensor sizes in MB (10^6 bytes)",
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args(argv)
    if args.backend == "nccl" and args.nproc > torch.cuda.device_count():
        parser.error(f"--nproc {args.nproc} needs {args.nproc} GPUs for nccl; {torch.cuda.device_count()} visible")
    if args.nproc < 2:
        parser.error("--nproc must be at least 2 for an all-reduce to communicate")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    return spawn_ranks(_rank, args, args.nproc, args.backend, lambda rows: _write(rows, args))


def _write(rows: list[dict], args: argparse.Namespace) -> None:
    title = f"All-reduce, {args.backend}, {args.nproc} processes, float32"
    write_results(
        f"comm_{args.backend}_{args.nproc}proc",
        rows,
        title,
        notes=f"Median of the slowest rank over {args.iters} calls after {args.warmup} warm-up calls; "
        "bus bandwidth = 2(n-1)/n · bytes / time.",
        plot=line_plot(rows, "size_mb", "busbw_GBps", series=["op"], title=title, log="x"),
        out_dir=args.out_dir,
    )


if __name__ == "__main__":
    main()
