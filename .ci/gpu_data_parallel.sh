#!/usr/bin/env bash
# Issue 30's data-parallel work on two CUDA GPUs of one host (torch 2.11; each stage fits one 10-minute call):
#   tests     python train.py --devices 2: SIGTERM stops both ranks under bucketed_ddp and zero3; bucketed_ddp, zero3
#             and zero1 against torch DDP in bf16-mixed (clipping inside fused AdamW's update: zero3's passed over NCCL
#             on 2 x H100, bucketed_ddp's on 2 x H200, 2026-11-27), zero1 in 16-mixed (reducing to owners under
#             torch's ShardedGradScaler: passed on 2 x H100), zero1's runs of the strategies' GPU tests, and the
#             gpu-marked compat tests (NCCL's grouped launch of reduces)
#   resumes   the zero1 and zero3 two-GPU resumes (passed 2026-11-26)
#   rank_watch  python train.py --devices 2 (bucketed_ddp, NCCL): kill -9 of rank 1, of rank 0, and an exception on
#             rank 1 each end the run in one line naming that rank and the checkpoint it resumes from, the survivor
#             gone within seconds, not NCCL's timeout (issue 59 item 6; passed over gloo on the CPU, not yet on GPUs)
#   tests_4gpu  on four GPUs: python train.py --devices 4 for bucketed_ddp, zero1 and zero3 in bf16-mixed against
#             torch DDP (tests/test_train_py_4gpu.py; not yet run on GPUs)
#   resumes_4gpu  the zero1 and zero3 four-GPU resumes (not yet run on GPUs)
#   compiled_tests  bucketed_ddp compiled in runs of blocks (--model.compile buckets) against torch DDP, bf16-mixed and
#             16-mixed (passed on 2 x H200, 2026-11-27)
#   scaling   xl compiled at 1024 x 8 per GPU through train.py, two rounds, interleaved (results are written after
#             every visit): one GPU and bucketed_ddp at its default (1000 MB buckets: 93.6-94.2% scaling on 2 x H100
#             in four calls; 95% asked)
#   zero1     the same for zero1 at its default (reducing to owners: 1.055-1.063x one GPU on 2 x H100, 2026-11-27;
#             1.07x asked) beside bucketed_ddp, one round
#   eager     the same at 512 x 4, eager, two rounds: one GPU, bucketed_ddp at its default (1000 MB), zero3, fsdp2
#             (2 x H100, 2026-11-27, one visit each: zero3 59.9-70.1% against 80% asked; single visits drift with
#             the host, one GPU read 153 and 173 ms four minutes apart, so each scaling takes its own round's)
#   trace     eager 512 x 4, one GPU, zero3 and bucketed_ddp, each followed by two steps traced on every rank: where
#             zero3's eager step goes (GPU compute, NCCL exposed, GPU idle while the host launches, host waits), the
#             measurement that divides its gap between host and link (scaling's --trace-steps: on 2 x H200, 2026-11-27,
#             the slower rank's host); the traces come back (in results.tar past 8 files), and the table splits the exposed
#             NCCL time by collective
#   zero3_prefetch  eager 512 x 4, two rounds, two steps traced after each visit: one GPU, zero3 at its default (the
#             next unit's all-gather started ahead) and with --trainer.strategy.prefetch 3 (three units ahead: the
#             trace of 2026-11-27 had each rank's all-gathers waiting for the other's host; on 2 x H100, 2026-11-27 12:41:
#             0.728 against the default's 0.672 scaling)
#   host_pair  eager 512 x 4, one GPU, alone and with a second one-GPU run beside it on the other GPU (no
#             communication between them), twice in turn: whether two processes on the host slow each one's
#             host-bound step, the part of the eager gap no strategy can remove (bucketed_ddp's own host work is
#             ~1.4 ms a step in a CPU probe; its two-GPU eager step ran 30 ms over one GPU's; on 2 x H100, 2026-11-27
#             12:47: the slower of two at once ran 0.80 and 0.88 of one alone)
#   interference  compiled 1024 x 8, one round, traced: one GPU, bucketed_ddp, and with bf16 gradients on the wire
#             (half NCCL's time, plus the casts): whether backward's slowdown beside NCCL falls as the 2026-11-27
#             CTA sweep's line (~8 ms plus ~0.2 ms per ms of NCCL) says (2 x H100, 2026-11-27 12:51: NCCL halved, the
#             casts added more than the slowdown gave back, 260.0 against 256.9 ms)
#   compile_runs  compiled 1024 x 8, one round: one GPU, bucketed_ddp with --model.compile buckets (a graph per run of
#             blocks sharing a bucket: 14 runs of xl at 1000 MB instead of 48 block graphs; its first visit compiles
#             four graph sizes, hence the longer visit limit) and at its default, per block (0.5-0.7% faster on 2 x H200, 2026-11-27)
#   train_step  on the first GPU alone, xl compiled through train.py against the plain PyTorch loop in one process
#             (benchmarks.train): train.py clips inside fused AdamW's update, the loop clips first (0.974-0.992x
#             on an H100, 2026-11-27; 1.009-1.020x before the fold)
#
#   .ci/gpu_data_parallel.sh tests        # one stage a call
#   .ci/gpu_data_parallel.sh scaling
# Writes logs, the tests' junit xml and the benchmark tables under $OUT (./gpu_data_parallel_out without it).
# Stages run under time limits; one that fails or times out is logged and the next one runs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_NAME=gpu_data_parallel_out source .ci/gpu_stages.sh  # $OUT; the wheels the GPU image lacks; record_versions; run
STAGES=("${@:-tests}")
record_versions

scaling() {  # scaling NAME CONFIG ROUNDS SETUPS... (in the environment, TRACE_STEPS=N: trace N steps after each
    local name=$1 config=$2 rounds=$3; shift 3  # visit; RUN_TIMEOUT=S: a visit's limit, 200 s unless set)
    run "$name" 560 python -m benchmarks.scaling --devices 2 --size xl --configs "$config" --attention sdpa \
        --setups "$@" --rounds "$rounds" --warmup 8 --steps 5 --segments 2 --run-timeout "${RUN_TIMEOUT:-200}" \
        --out-dir "$OUT/$name" --trace-steps "${TRACE_STEPS:-0}"
}

for stage in "${STAGES[@]}"; do
    case $stage in
    tests)
        run train_py_2gpu 570 python -m pytest -q -p no:cacheprovider tests/test_train_py_2gpu.py \
            -k "sigterm or bucketed_ddp-bf16-mixed or zero3-bf16-mixed or zero1-bf16-mixed or zero1-16-mixed" \
            --junitxml="$OUT/train_py_2gpu.xml"
        run strategies_zero1 200 python -m pytest -q -p no:cacheprovider tests/strategy_tests/test_strategies_gpu.py -k zero1 \
            --junitxml="$OUT/strategies_zero1.xml"
        run compat_gpu 120 python -m pytest -q -p no:cacheprovider -m gpu tests/compat --junitxml="$OUT/compat_gpu.xml"
        ;;
    rank_watch)
        run rank_watch_2gpu 300 python -m pytest -q -p no:cacheprovider tests/test_train_py_2gpu.py -k rank_that_dies \
            --junitxml="$OUT/rank_watch_2gpu.xml"
        ;;
    compiled_tests)
        run compiled_2gpu 570 python -m pytest -q -p no:cacheprovider tests/test_train_py_2gpu.py -k compile \
            --junitxml="$OUT/compiled_2gpu.xml"
        ;;
    tests_4gpu)
        run train_py_4gpu 570 python -m pytest -q -p no:cacheprovider tests/test_train_py_4gpu.py \
            -k "bf16-mixed and (bucketed_ddp or zero1 or zero3) and not compile and not all_reduce" \
            --junitxml="$OUT/train_py_4gpu.xml"
        ;;
    resumes_4gpu)
        run resumes_4gpu 570 python -m pytest -q -p no:cacheprovider tests/test_train_py_4gpu.py \
            -k "resume and (zero1 or zero3)" --junitxml="$OUT/resumes_4gpu.xml"
        ;;
    resumes)
        run resumes_2gpu 570 python -m pytest -q -p no:cacheprovider tests/test_train_py_2gpu.py \
            -k "resume and (zero1 or zero3)" --junitxml="$OUT/resumes_2gpu.xml"
        ;;
    scaling)
        scaling scaling 1024x8:compiled 2 single bucketed_ddp
        ;;
    zero1)
        scaling zero1 1024x8:compiled 1 single zero1 bucketed_ddp
        ;;
    eager)
        scaling eager 512x4:eager 2 single bucketed_ddp zero3 fsdp2
        ;;
    trace)
        TRACE_STEPS=2 scaling trace 512x4:eager 1 single zero3 bucketed_ddp
        ;;
    zero3_prefetch)
        TRACE_STEPS=2 scaling zero3_prefetch 512x4:eager 2 single zero3 zero3+prefetch=3
        ;;
    interference)
        TRACE_STEPS=2 scaling interference 1024x8:compiled 1 single bucketed_ddp bucketed_ddp+grad_comm_dtype=bf16
        ;;
    host_pair)
        for turn in 1 2; do
            CUDA_VISIBLE_DEVICES=0 scaling "host_alone$turn" 512x4:eager 1 single
            CUDA_VISIBLE_DEVICES=0 scaling "host_beside$turn" 512x4:eager 1 single &
            CUDA_VISIBLE_DEVICES=1 scaling "host_other$turn" 512x4:eager 1 single
            wait
        done
        ;;
    compile_runs)
        RUN_TIMEOUT=400 scaling compile_runs 1024x8:compiled 1 single bucketed_ddp+--model.compile=buckets bucketed_ddp
        ;;
    train_step)
        CUDA_VISIBLE_DEVICES=0 run train_step 570 python -m benchmarks.train --shapes 512x4 2048x1 --compile on \
            --attention sdpa --rounds 6 --out-dir "$OUT/train_step"
        ;;
    *)
        echo "unknown stage $stage (tests, tests_4gpu, resumes_4gpu, compiled_tests, resumes, rank_watch, scaling, zero1, eager, trace, zero3_prefetch," \
            "host_pair, interference, compile_runs, train_step)"; exit 2
        ;;
    esac
done
cat "$OUT/summary.txt"
bundle_if_many "$OUT"
