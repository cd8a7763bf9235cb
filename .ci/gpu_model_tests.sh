#!/usr/bin/env bash
# The gpu-marked tests of the model's recompute and fused loss on one CUDA GPU (torch 2.11, triton 3.6): a few
# minutes, most of it compiling.
#   recompute  compiled blocks with flash_triton: backward launches an attention forward kernel again under blocks,
#              none under keep_attention, and both give the gradients of keeping everything; the same of eager
#              flash_triton's forward in a block (a CPU test, here on the GPU's kernels)
#   loss       the fused loss's chunk kernels against float64 at the 8B model's vocabulary, within a chunk's memory
#
#   .ci/gpu_model_tests.sh             # both
# Writes logs and junit xml under $OUT (./gpu_model_tests_out without it).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_NAME=gpu_model_tests_out source .ci/gpu_stages.sh  # $OUT; the wheels the GPU image lacks; record_versions; run
STAGES=("$@")
[ $# -eq 0 ] && STAGES=(recompute loss)
record_versions

for stage in "${STAGES[@]}"; do
    case $stage in
    recompute)
        run recompute_gpu 300 python -m pytest -q -p no:cacheprovider -m gpu tests/test_recompute.py \
            --junitxml="$OUT/recompute_gpu.xml"
        run recompute_eager_triton_gpu 120 python -m pytest -q -p no:cacheprovider tests/test_recompute.py \
            -k eager_triton --junitxml="$OUT/recompute_eager_triton_gpu.xml"
        ;;
    loss)
        run loss_gpu 300 python -m pytest -q -p no:cacheprovider -m gpu tests/test_loss.py tests/test_loss_kernel.py \
            --junitxml="$OUT/loss_gpu.xml"
        ;;
    *)
        echo "unknown stage $stage (recompute, loss)"; exit 2
        ;;
    esac
done
cat "$OUT/summary.txt"
