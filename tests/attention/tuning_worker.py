"""A process that launches a tuned copy kernel once: ``python tuning_worker.py OUT_JSON BENCH_SECONDS``.

Its benchmark is a stand-in (the CPU interpreter has no clock worth timing): it launches the candidate,
sleeps BENCH_SECONDS and reports 2 ms for the first candidate and 1 ms for the second, so the second
(BLOCK 16) wins. It writes how many candidates it timed and the BLOCK it launched with to OUT_JSON; the
cache folder comes from LM_SYSTEMS_TUNING_CACHE.
"""

import json
import sys
import time

import torch
import triton
import triton.language as tl

from lm_systems.attention.tuning import TunedKernel

CONFIGS = [triton.Config({"BLOCK": 32}), triton.Config({"BLOCK": 16})]


@triton.jit
def copy_kernel(X, Y, n, N_KEY, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < n), mask=offs < n)


def main(out_json: str, bench_seconds: float) -> None:
    timed: list[float] = []

    def bench(launch) -> float:
        launch()
        time.sleep(bench_seconds)
        timed.append(2.0 - len(timed))
        return timed[-1]

    kernel = TunedKernel(copy_kernel, CONFIGS, ["N_KEY"], lambda configs, named: configs, "copy-v1", bench=bench)
    x = torch.arange(100, dtype=torch.float32)
    y = torch.zeros_like(x)
    kernel[lambda meta: (triton.cdiv(100, meta["BLOCK"]),)](x, y, 100, 128)
    assert torch.equal(x, y)
    with open(out_json, "w") as out:
        json.dump({"timed": len(timed), "block": kernel.best_config.kwargs["BLOCK"]}, out)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
