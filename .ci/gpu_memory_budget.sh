#!/usr/bin/env bash
# The memory-budget recompute policy on ONE CUDA GPU (an H200: 139.8 GiB), through train.py, the 8B model of
# configs/leaderboard_8b.yaml at batch 1 × 32,768 (bf16-true, compiled, full parameters, gradients and AdamW state on
# the one GPU; about 1 min 45 s to the first step):
#   budget        keep_attention (the config's policy before auto) against auto at --model.memory_budget $BUDGET (0.9
#                 without it), one run each: s a step and peak allocated / reserved per run (about 6 min on a fresh
#                 machine; on one H200, 2026-12-01: 4.93 s at 68.3 GiB against 4.57 s at 122.9 GiB)
#   keep_attention, auto  the budget stage's two runs one at a time: with ATTENTION=flash_triton each compiles and
#                 tunes our kernels for 3-3.5 min before its first step (H200, 2026-12-02), so they take a call each
#   attention_pair  auto at 0.9 with --model.attention flash_triton, then with sdpa (the 8B config's), $STEPS steps
#                 each, and the ratio of their tokens/s (ours × SDPA's speed); about 5.5 minutes on a fresh machine
#                 (2026-12-02, STEPS=4: 0.987-0.996); on a warm one each run starts in under a minute, so a second
#                 pair fits the same 10-minute call
#   oom           --model.activation_checkpointing none, eager, runs out of memory in the first forward: exit 1, one
#                 error line, no traceback (about 30 s)
#   torch_budget  torch's own partitioner budget instead: none + torch._functorch.config.activation_memory_budget
#                 $TORCH_BUDGET (0.35 without it; out of memory in the first step at 0.35, in the second at 0.15, one
#                 H200) under torch.compile (the whole model, one GPU), for comparison; a call of its own (about 3-4
#                 min, its knapsack over the 34 blocks' graph included)
#   xl, 2.7b      configs/<size>.yaml on the one GPU under each fixed policy and auto (the issue's "auto never slower
#                 than the fastest fixed policy that fits"; about 6-9 min a size: a call each)
#
#   .ci/gpu_memory_budget.sh budget oom     # stages in order, each under its own time limit (about 7 min with SDPA)
#   ATTENTION=flash_triton .ci/gpu_memory_budget.sh keep_attention   # then auto in a second call: our attention
# Writes each run's log and $OUT/summary.txt (s a step, peak; ./gpu_memory_budget_out without OUT).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_NAME=gpu_memory_budget_out source .ci/gpu_stages.sh  # $OUT; the wheels the GPU image lacks; record_versions; run
STAGES=("${@:-budget}")
BUDGET=${BUDGET:-0.9}  # --model.memory_budget of the budget stage's auto run
TORCH_BUDGET=${TORCH_BUDGET:-0.35}  # torch_budget's activation_memory_budget
ATTENTION=${ATTENTION:-}  # --model.attention of every run (flash_triton: ours); the config's without it
STEPS=${STEPS:-4}  # steps of the budget, auto and attention_pair runs (the speed line is the mean after step 1)
record_versions
export PYTHONPATH=.

EIGHT_B=(-c configs/leaderboard_8b.yaml --trainer.devices 1 --trainer.strategy auto --trainer.logger false
    --trainer.enable_progress_bar false ${ATTENTION:+--model.attention "$ATTENTION"})

step8b() {  # step8b NAME LIMIT STEPS FLAGS...: one train.py run of the 8B; its speed and memory lines to summary.txt
    local name=$1 limit=$2 steps=$3; shift 3
    run "$name" "$limit" python train.py "${EIGHT_B[@]}" --trainer.max_steps "$steps" "$@"
    grep -E "activation checkpointing auto|speed|memory|^error" "$OUT/$name.log" | sed "s/^/$name: /" \
        | tee -a "$OUT/summary.txt"
}

for stage in "${STAGES[@]}"; do
    case $stage in
    budget | keep_attention | auto)
        # the first run on a fresh machine compiles from empty caches: over 3 minutes at 8B (2026-12-01)
        [ "$stage" = auto ] || step8b keep_attention $((310 + 5 * STEPS)) "$STEPS" \
            --model.activation_checkpointing keep_attention
        [ "$stage" = keep_attention ] || step8b "auto_$BUDGET" $((280 + 5 * STEPS)) "$STEPS" \
            --model.activation_checkpointing auto --model.memory_budget "$BUDGET"
        ;;
    attention_pair)
        for attention in flash_triton sdpa; do  # the later --model.attention wins over ATTENTION's
            step8b "pair_$attention" $((180 + 5 * STEPS)) "$STEPS" --model.activation_checkpointing auto \
                --model.memory_budget 0.9 --model.attention "$attention"
        done
        python - "$OUT" <<'RATIO' | tee -a "$OUT/summary.txt"
import re, sys
rate = {}
for name in ("flash_triton", "sdpa"):
    found = re.search(r"speed +([\d,]+) tokens/s", open(f"{sys.argv[1]}/pair_{name}.log").read())
    rate[name] = int(found.group(1).replace(",", "")) if found else None
if None in rate.values():
    print("attention_pair: a run gave no speed line (its log says why)")
else:
    print(f"attention_pair: flash_triton {rate['flash_triton']:,} tokens/s, sdpa {rate['sdpa']:,}: ours "
          f"{rate['flash_triton'] / rate['sdpa']:.3f}x SDPA's speed")
RATIO
        ;;
    oom)
        step8b oom_none 120 2 --model.activation_checkpointing none --model.compile false  # eager: out of memory in the first forward, not after a compile
        errors=$(grep -c "^error: CUDA out of memory in " "$OUT/oom_none.log")
        traceback=$(grep -c "Traceback" "$OUT/oom_none.log")
        echo "oom_none: $errors error line(s), $traceback traceback(s) (expected: exit 1, 1 line, 0 tracebacks)" \
            | tee -a "$OUT/summary.txt"
        grep "^error: " "$OUT/oom_none.log" | tee -a "$OUT/summary.txt"
        ;;
    torch_budget)
        run torch_budget 240 python -c "
import runpy, sys
import torch._functorch.config as functorch_config
functorch_config.activation_memory_budget = $TORCH_BUDGET
sys.argv = ['train.py', *sys.argv[1:]]
runpy.run_path('train.py', run_name='__main__')
" "${EIGHT_B[@]}" --trainer.max_steps 4 --model.activation_checkpointing none
        grep -E "speed|memory|^error" "$OUT/torch_budget.log" | sed "s/^/torch_budget $TORCH_BUDGET: /" | tee -a "$OUT/summary.txt"
        ;;
    xl | 2.7b)
        # configs/<size>.yaml as shipped (eager, bf16-mixed, batch 8 x 4 micro-batches) on the one GPU: every fixed
        # policy, then auto; one that does not fit ends in its one out-of-memory line
        for policy in none keep_projections selective keep_attention blocks auto; do
            run "${stage}_$policy" 150 python train.py -c "configs/$stage.yaml" --trainer.devices 1 \
                --trainer.max_steps 8 --trainer.logger false --trainer.enable_progress_bar false \
                --trainer.enable_checkpointing false --trainer.val_check_interval 1000 \
                --model.activation_checkpointing "$policy"
            grep -E "activation checkpointing auto|speed|memory|^error" "$OUT/${stage}_$policy.log" \
                | sed "s/^/${stage}_$policy: /" | tee -a "$OUT/summary.txt"
        done
        ;;
    *)
        echo "unknown stage $stage (budget, keep_attention, auto, attention_pair, oom, torch_budget, xl, 2.7b)"; exit 2
        ;;
    esac
done
