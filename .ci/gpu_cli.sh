#!/usr/bin/env bash
# Issue 60 item 5's command line on one CUDA GPU (torch 2.11, lightning 2.6; each stage fits one 10-minute call):
#   door        the command line as a user types it: --help, a bad --precision and --trainer.precision (exit 2, one
#               line "--precision '8-bit' is not one of: ..."), a bad --strategy (exit 2, the names), flash_triton
#               with --accelerator cpu (exit 2), and a 3-step tiny run in bf16-mixed on the GPU (exit 0, its summary)
#   strategies  tests/test_train_py_gpu.py's 28 runs of every strategy in every precision through train.py, in two
#               halves at once
#   rest        the rest of tests/test_train_py_gpu.py: the default run, compiled, flash_triton, an exact resume
#   configs     every shipped config for 12 steps but the large ones; configs_large: 2.7b, xl, the 8B, long context
#
#   .ci/gpu_cli.sh rest configs       # one stage or more a call; all five without arguments
# Writes logs and junit xml under $OUT (./gpu_cli_out without it): door's in a few minutes, each other stage under 10.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_NAME=gpu_cli_out source .ci/gpu_stages.sh  # $OUT; the wheels the GPU image lacks; record_versions; run
export PYTHONPATH=.
STAGES=("$@")
[ $# -eq 0 ] && STAGES=(door strategies rest configs configs_large)
record_versions

for stage in "${STAGES[@]}"; do
    case $stage in
    door)
        export XDG_CACHE_HOME="$OUT/cache"
        run help 120 python train.py --help
        run bad_precision 120 python train.py --precision 8-bit
        run bad_trainer_precision 120 python train.py --trainer.precision 8-bit
        run bad_strategy 120 python train.py --strategy nope
        run triton_on_cpu 120 python train.py --model.attention flash_triton --accelerator cpu
        run tiny_bf16 300 python train.py --max_steps 3 --model.size tiny --precision bf16-mixed \
            --trainer.default_root_dir "$OUT/tiny_run" --data.cache_dir "$OUT/cache/data"
        ;;
    strategies)
        # 28 train.py runs of about 26 s each (12.5 min in a row on an H100): the bf16 half and the rest side by side
        for half in bf16 "not bf16"; do
            name=strategies_gpu_${half// /_}
            run "$name" 590 python -m pytest -q -p no:cacheprovider tests/test_train_py_gpu.py \
                -k "strategy_and_precision and $half" --junitxml="$OUT/$name.xml" &
        done
        wait
        ;;
    rest)
        run rest_gpu 590 python -m pytest -q -p no:cacheprovider tests/test_train_py_gpu.py \
            -k "not strategy_and_precision and not shipped_config" --junitxml="$OUT/rest_gpu.xml"
        ;;
    configs | configs_large)  # the shipped configs, the large ones (2.7b, xl, the 8B, long context) on their own
        large="2.7b or xl or leaderboard or long_context"
        [ "$stage" = configs ] && which="not ($large)" || which="$large"
        run "${stage}_gpu" 590 python -m pytest -q -p no:cacheprovider tests/test_train_py_gpu.py \
            -k "shipped_config and ($which)" --junitxml="$OUT/${stage}_gpu.xml"
        ;;
    *)
        echo "unknown stage $stage (door, strategies, rest, configs, configs_large)"; exit 2
        ;;
    esac
done
rm -rf "$OUT/cache" "$OUT/tiny_run"
cat "$OUT/summary.txt"
bundle_if_many "$OUT"
