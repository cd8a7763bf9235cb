#!/usr/bin/env bash
# Issue 33's attention work on one CUDA GPU (about 8 minutes on an H100; torch 2.11, triton 3.6):
#   tune      the tuning cache: one process tunes the headline shapes, a second reads them (both timed; on an H100,
#             2026-11-27: 29.0 and 34.2 s, then 0.5 and 0.0 s)
#   headline  python -m benchmarks.attention --mode headline (B1 H16 N16384 bf16 causal, d 64 and 128,
#             flash_triton compiled and eager against SDPA flash and cuDNN, interleaved), with the tuned cache (on an
#             H100, 2026-11-27: d64 5.04 ms compiled, 0.89 of cuDNN's 4.48; d128 451 TFLOP/s against cuDNN's 533)
#   pointer_loads  the same with LM_SYSTEMS_FLASH_TMA=0: the backward's pointer loads, against headline's descriptor
#             (TMA) loads on Hopper (each run against its own cuDNN; on an H200, 2026-11-27: d64 0.856 against 0.875)
#   tests     the gpu-marked attention tests (float64 references; the autotuned headline shapes; 20 passed on an
#             H100, 2026-11-27)
#   long      medium at context 8192 through train.py, flash_triton against sdpa (benchmarks.scaling)
#   hopper    on sm_90: the Gluon kernels flash_triton takes at d 128 (lm_systems/attention/hopper) against float64
#             (tests/attention/test_hopper_gpu.py, with Triton < 3.9 through the shipped PTX), then the headline
#             benchmark (its d 128 rows and d 64 backward are theirs; flash_triton_portable the portable kernels). Not in
#             the default list; about 4 minutes.
#   ncu       Nsight Compute (hardware counters: the Firecracker runtime only) on one backward at the 8B model's
#             B1 H32 N32768 d 128 (or $NCU_ARGS: benchmarks.attention_ncu's shape flags) of each of $NCU_IMPLS
#             (flash_triton sdpa_cudnn without it; benchmarks.attention_ncu):
#             speed of light, occupancy, waves, warp stalls, L2; ncu's CSV in each log. Not in the default list.
#   ncu_stalls  the same, every raw counter of the warp-state and instruction sections: each stall reason's cycles
#             per issued instruction and the instruction mix. Not in the default list.
#   clocks    the same backward of ours and cuDNN's cold and at the card's power limit, with the SM clock and power
#             (benchmarks.attention_clocks; about 2 minutes). Not in the default list.
#   ab        AB_HOPPER=DIR: another lm_systems/attention/hopper (a patch's, its PTX written with Triton >= 3.9; keep
#             it under .gl/, which carry takes) against the package's: its GPU tests, then clocks A B A B, each process
#             against its own cuDNN (about 6 minutes). Not in the default list.
#
#   .ci/gpu_attention.sh                  # all four, in this order (about 10 minutes)
#   .ci/gpu_attention.sh tune headline tests && .ci/gpu_attention.sh long   # in two calls of under 10 minutes
# Writes logs, the tests' junit xml and the benchmark tables (results/) under $OUT (./gpu_attention_out
# without it). Stages run under time limits; one that fails or times out is logged and the next one runs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_NAME=gpu_attention_out source .ci/gpu_stages.sh  # $OUT; the wheels the GPU image lacks; run
mkdir -p "$OUT/results"
STAGES=("$@")
[ $# -eq 0 ] && STAGES=(tune headline tests long)

python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
torch.cuda.get_device_name(), torch.cuda.get_device_capability())" | tee "$OUT/versions.txt"

for stage in "${STAGES[@]}"; do
    case $stage in
    tune)
        python -m lm_systems.attention.tune --clear | tee -a "$OUT/summary.txt"
        # Each process: python start, imports, then per shape one forward + backward (compile or load, tune or read).
        run tune_first_process 200 python -m lm_systems.attention.tune --seq 16384 --head-dim 64 128 --heads 16
        run tune_second_process 60 python -m lm_systems.attention.tune --seq 16384 --head-dim 64 128 --heads 16
        grep -h "^B1" "$OUT"/tune_*_process.log | tee -a "$OUT/summary.txt"
        ;;
    headline)
        run headline 180 python -m benchmarks.attention --mode headline --rounds 3 --out-dir "$OUT/results"
        ;;
    pointer_loads)
        LM_SYSTEMS_FLASH_TMA=0 run headline_pointer_loads 200 python -m benchmarks.attention --mode headline --rounds 3 \
            --out-dir "$OUT/results_pointer_loads"
        ;;
    tests)  # after tune: the autotuned headline-shape tests read this machine's tuning cache
        run gpu_tests 240 python -m pytest -q -m gpu tests/attention -p no:cacheprovider \
            --junitxml="$OUT/gpu_attention_tests.xml"
        ;;
    long)
        run tune_long_context 90 python -m lm_systems.attention.tune --seq 8192 --head-dim 64 --heads 16 --batch 2
        run long_context 300 python -m benchmarks.scaling --devices 1 --size medium --configs 8192x2:compiled \
            --name long_context --setups single+--model.attention=sdpa single+--model.attention=flash_triton \
            --baseline single+--model.attention=sdpa --rounds 1 --warmup 5 --steps 5 --segments 2 \
            --run-timeout 140 --out-dir "$OUT/results"
        ;;
    hopper)
        run hopper_tests 240 python -m pytest -q -m gpu tests/attention/test_hopper_gpu.py -p no:cacheprovider \
            --junitxml="$OUT/hopper_tests.xml"
        run hopper_headline 300 python -m benchmarks.attention --mode headline --rounds 3 --out-dir "$OUT/results"
        ;;
    ncu)
        for impl in ${NCU_IMPLS:-flash_triton sdpa_cudnn}; do
            run "ncu_$impl" 200 ncu --clock-control none --profile-from-start off --csv --page details \
                --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
                --section SchedulerStats --section MemoryWorkloadAnalysis \
                python -m benchmarks.attention_ncu --impl "$impl" ${NCU_ARGS:-}
        done
        ;;
    ncu_stalls)
        for impl in ${NCU_IMPLS:-flash_triton sdpa_cudnn}; do
            run "ncu_stalls_$impl" 200 ncu --clock-control none --profile-from-start off --csv --page raw \
                --section WarpStateStats --section InstructionStats \
                python -m benchmarks.attention_ncu --impl "$impl" ${NCU_ARGS:-}
        done
        ;;
    clocks)
        run clocks 240 python -m benchmarks.attention_clocks --out-dir "$OUT/results"
        ;;
    ab)
        [ -d "${AB_HOPPER:-}/compiled" ] || { echo "ab: set AB_HOPPER to a copy of lm_systems/attention/hopper"; exit 2; }
        package=$(mktemp -d) && cp -r lm_systems/attention/hopper "$package/"
        take() { rm -rf lm_systems/attention/hopper && cp -r "$1" lm_systems/attention/hopper; }
        take "$AB_HOPPER"
        run ab_b_tests 240 python -m pytest -q -m gpu tests/attention/test_hopper_gpu.py -p no:cacheprovider \
            --junitxml="$OUT/ab_b_tests.xml"
        for variant in a b a b; do
            if [ $variant = a ]; then take "$package/hopper"; else take "$AB_HOPPER"; fi
            run "ab_clocks_$variant" 120 python -m benchmarks.attention_clocks --rounds 2 --out-dir "$OUT/ab_$variant"
            grep -h "^| hot | flash_triton" "$OUT/ab_$variant/attention_clocks.md" | sed "s/^/$variant /" \
                | tee -a "$OUT/summary.txt"
        done
        take "$package/hopper"
        ;;
    *)
        echo "unknown stage $stage (tune, headline, pointer_loads, tests, long, hopper, ncu, ncu_stalls, clocks, ab)"; exit 2
        ;;
    esac
done
cat "$OUT/summary.txt"
bundle_if_many "$OUT"
