"""The causal backward at the card's power limit: ``python -m benchmarks.attention_clocks``.

Times one causal bf16 backward of each implementation two ways, reading the SM clock and the power draw (NVML,
through ``torch.cuda``) while it runs: cold (a few backwards after an idle pause, the clock at its top) and hot (many
back to back, as in a training step, where the card holds its power limit by lowering the clock). Implementations
alternate, their order reversed every round. Against the last implementation named (``sdpa_cudnn`` by default):
``time_ratio`` is its time over ours (above 1: ours is faster) and ``cycles_ratio`` the same of time × clock, what
the kernels do per clock. ``.ci/gpu_attention.sh clocks`` runs it at the 8B model's attention shape.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from benchmarks.attention import headline_environment
from benchmarks.attention_ncu import IMPLEMENTATIONS, add_shape_arguments, causal_backward
from benchmarks.report import argument_parser, write_results

SAMPLE_EVERY_S = 0.02


class ClockSampler:
    """SM clock (MHz) and power (W) of GPU 0, read every ``SAMPLE_EVERY_S`` on a thread while in use."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), torch.cuda.clock_rate(), torch.cuda.power_draw() / 1000))
            time.sleep(SAMPLE_EVERY_S)

    def __enter__(self) -> ClockSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @contextmanager
    def window(self, into: dict) -> Iterator[None]:
        """Adds the mean clock and power of the samples taken inside the block to ``into``."""
        start = time.monotonic()
        yield
        inside = [s for s in self.samples if start <= s[0] <= time.monotonic()]
        into["sm_mhz"] = statistics.mean(s[1] for s in inside) if inside else float("nan")
        into["watts"] = statistics.mean(s[2] for s in inside) if inside else float("nan")


def time_backwards(backward: Callable[[], None], count: int, sampler: ClockSampler) -> dict[str, float]:
    """Milliseconds a backward over ``count`` back to back, with the clock and power while they ran."""
    row: dict[str, float] = {}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    with sampler.window(row):
        start.record()
        for _ in range(count):
            backward()
        end.record()
        torch.cuda.synchronize()
    row["ms"] = start.elapsed_time(end) / count
    return row


def summary(rows: list[dict], baseline: str) -> list[dict]:
    """Per implementation and mode: the median time, clock and power over the rounds, and the baseline's time and
    cycles (time × clock) over these."""
    out = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        medians = {}
        for impl in dict.fromkeys(r["impl"] for r in rows):
            mine = [r for r in rows if r["impl"] == impl and r["mode"] == mode]
            medians[impl] = {k: statistics.median(r[k] for r in mine) for k in ("ms", "sm_mhz", "watts")}
        base = medians[baseline]
        for impl, m in medians.items():
            cycles_ratio = base["ms"] * base["sm_mhz"] / (m["ms"] * m["sm_mhz"])
            out.append(
                {"mode": mode, "impl": impl, **m, "time_ratio": base["ms"] / m["ms"], "cycles_ratio": cycles_ratio}
            )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--impls", nargs="+", choices=IMPLEMENTATIONS, default=["flash_triton", "sdpa_cudnn"])
    add_shape_arguments(parser)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--cold", type=int, default=3, help="backwards timed after the idle pause")
    parser.add_argument("--hot", type=int, default=60, help="backwards timed back to back")
    parser.add_argument("--idle-s", type=float, default=2.0, help="pause before each implementation's cold run")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (and NVML: the nvidia-ml-py package)")
    backwards = {}
    for name in args.impls:
        with headline_environment(name):
            backwards[name] = causal_backward(name, args)
    rows = []
    with ClockSampler() as sampler:
        for round_ in range(args.rounds):
            for name in args.impls if round_ % 2 == 0 else args.impls[::-1]:
                with headline_environment(name):
                    time.sleep(args.idle_s)
                    for mode, count in (("cold", args.cold), ("hot", args.hot)):
                        rows.append({"round": round_, "impl": name, "mode": mode,
                                     **time_backwards(backwards[name], count, sampler)})  # fmt: skip
                        print(
                            " ".join(
                                f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in rows[-1].items()
                            )
                        )
    shape = f"B{args.batch} H{args.heads} N{args.seq} d{args.head_dim}"
    write_results(
        "attention_clocks",
        summary(rows, baseline=args.impls[-1]),
        f"Causal bf16 backward at {shape}: cold and at the power limit",
        notes=f"{args.rounds} rounds; cold: {args.cold} backwards after {args.idle_s} s idle; hot: {args.hot} back "
        f"to back. Ratios against {args.impls[-1]}: its time (cycles) over each one's.",
        out_dir=args.out_dir,
    )


if __name__ == "__main__":
    main()
