#!/usr/bin/env bash
# Issue 59's checkpoint directories on one CUDA GPU, through train.py: the 2.7b model under zero3 on one device (its
# checkpoints are directories, saved in the background), bf16-true (bf16 weights and AdamW state: 20 GB a
# checkpoint, so two fit the 64 GiB disk), synthetic tokens, 4 x 256 tokens a step, 20 steps:
#   save     a save every 10 steps (steps 10 and 20); step times, peak host memory, the bytes on disk
#   nosave   the same run without checkpoints: the step times to compare with
#   resume   step 20's directory removed, the run resumed from step 10's to step 20: its losses against save's
#   eight_b  configs/leaderboard_8b.yaml on the one GPU under zero3 (auto recompute, compiled), 7 steps, a save at
#            step 4: 48.8 GB, so the disk (64 GiB) refuses the end of fit's second one in one line (exit 1), after the
#            step clock is written
#   eight_b_twice  the same 8B run twice without saves: whether an uninterrupted run repeats its losses to the bit
#            (the resumed 8B run's first step did; its next two differed by 1e-5)
#   summary  the pause per save (the interval after a saving step less the median interval), step 1's interval
#            (the staging buffers are made after its optimizer step, not in the first save), peak RSS, bytes
#            on disk against the state's, the resumed losses against the uninterrupted ones
#
#   .ci/gpu_checkpoints.sh                     # all, in this order (about 6 minutes; not measured yet)
#   .ci/gpu_checkpoints.sh save nosave && .ci/gpu_checkpoints.sh resume summary   # in two calls of under 5 minutes
# Writes logs, the step clocks (*.json) and summary.txt under $OUT (./gpu_checkpoints_out without it); the runs'
# checkpoints go to $RUNS (/tmp/gpu_checkpoints_runs), not $OUT. Stages run under time limits; one that fails or
# times out is logged and the next one runs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_NAME=gpu_checkpoints_out source .ci/gpu_stages.sh  # $OUT; the wheels the GPU image lacks; run
RUNS=${RUNS:-/tmp/gpu_checkpoints_runs}
mkdir -p "$RUNS"
export PYTHONPATH=.
STAGES=("$@")
[ $# -eq 0 ] && STAGES=(save nosave resume summary)
record_versions
df -h "$RUNS" | tee -a "$OUT/summary.txt"

RUN=(python train.py --model.size 2.7b --trainer.precision bf16-true --strategy zero3 --devices 1
    --data.synthetic true --data.vocab_size 32000 --data.batch_size 4 --trainer.accumulate_grad_batches 1
    --model.warmup_steps 5 --max_steps 20 --trainer.limit_val_batches 0 --model.sample_prompt ""
    --trainer.callbacks+=tests.step_clock.StepClock)

for stage in "${STAGES[@]}"; do
    case $stage in
    save)
        rm -rf "$RUNS/save"
        run save 240 "${RUN[@]}" --checkpointing_interval 10 --trainer.default_root_dir "$RUNS/save" \
            --trainer.callbacks.out "$OUT/save.json"
        du -sb "$RUNS"/save/logs/*/version_*/checkpoints/step=10.ckpt | tee -a "$OUT/summary.txt"
        ;;
    eight_b)
        rm -rf "$RUNS"  # the 2.7b runs' checkpoints: the disk holds one 8B checkpoint, not them as well
        mkdir -p "$RUNS"
        run eight_b 540 python train.py -c configs/leaderboard_8b.yaml --trainer.devices 1 --trainer.strategy zero3 \
            --trainer.max_steps 7 --trainer.enable_checkpointing true --checkpointing_interval 4 \
            --trainer.enable_progress_bar false --trainer.default_root_dir "$RUNS/eight_b" \
            --trainer.callbacks+=tests.step_clock.StepClock --trainer.callbacks.out "$OUT/eight_b.json"
        grep -E "speed|memory|^error" "$OUT/eight_b.log" | sed "s/^/eight_b: /" | tee -a "$OUT/summary.txt"
        ;;
    eight_b_twice)
        for twin in a b; do
            run "eight_b_$twin" 300 python train.py -c configs/leaderboard_8b.yaml --trainer.devices 1 \
                --trainer.strategy zero3 --trainer.max_steps 7 --trainer.enable_progress_bar false \
                --trainer.default_root_dir "$RUNS/eight_b_$twin" \
                --trainer.callbacks+=tests.step_clock.StepClock --trainer.callbacks.out "$OUT/eight_b_$twin.json"
        done
        ;;
    nosave)
        run nosave 180 "${RUN[@]}" --trainer.enable_checkpointing false --trainer.default_root_dir "$RUNS/nosave" \
            --trainer.callbacks.out "$OUT/nosave.json"
        ;;
    resume)
        rm -rf "$RUNS"/save/logs/*/version_*/checkpoints/step=20.ckpt "$RUNS/resume"
        run resume 180 "${RUN[@]}" --ckpt_path "$(ls -d "$RUNS"/save/logs/*/version_*/checkpoints/step=10.ckpt)" \
            --trainer.default_root_dir "$RUNS/resume" --trainer.callbacks.out "$OUT/resume.json"
        ;;
    summary)
        python - "$OUT" "$RUNS" <<'PY' | tee -a "$OUT/summary.txt"
import json, statistics, sys
from pathlib import Path
out, runs = Path(sys.argv[1]), Path(sys.argv[2])
clock = {name: json.loads((out / f"{name}.json").read_text()) for name in ("save", "nosave", "resume", "eight_b")
         if (out / f"{name}.json").exists()}
for name, record in clock.items():
    steady = record["intervals_s"][3:]  # after the first steps' warm-up
    print(f"{name}: median step {statistics.median(steady):.3f} s, peak RSS {record['peak_rss_gib']:.1f} GiB")
if {"save", "nosave"} <= clock.keys():
    median = statistics.median(clock["nosave"]["intervals_s"][3:])
    save = clock["save"]
    # steps[i] is the global step as batch i starts; intervals_s[i - 1] ends there: for steps[i] == 10 it holds
    # the last batch of step 10 and the save that followed it.
    index = save["steps"].index(10) - 1
    print(f"step 10's save paused the loop {save['intervals_s'][index] - median:.3f} s "
          f"(interval {save['intervals_s'][index]:.3f} s, median without saves {median:.3f} s)")
    # The staging buffers (pinned host memory) are made after step 1's optimizer step: its interval pays for them.
    first = save["steps"].index(1) - 1
    print(f"step 1 with the staging buffers made: {save['intervals_s'][first]:.3f} s, "
          f"without saves {clock['nosave']['intervals_s'][first]:.3f} s")
if "eight_b" in clock:  # the steps after the first (compiling, the staging buffers made) against step 4's save
    record = clock["eight_b"]
    index = record["steps"].index(4) - 1
    others = [t for i, t in enumerate(record["intervals_s"]) if i not in (0, index)]
    median = statistics.median(others)
    print(f"8B: step 4's save paused the loop {record['intervals_s'][index] - median:.3f} s "
          f"(interval {record['intervals_s'][index]:.3f} s, median of the others {median:.3f} s, "
          f"step 1, compiled and the staging buffers made: {record['intervals_s'][0]:.3f} s)")
twins = [out / f"eight_b_{twin}.json" for twin in "ab"]
if all(twin.exists() for twin in twins):
    a, b = (json.loads(twin.read_text())["losses"] for twin in twins)
    print("8B twice, losses:", a, b, "equal:", a == b)
directory = next(runs.glob("save/logs/*/version_*/checkpoints/step=10.ckpt"), None)
if directory is not None:
    from lm_systems.files.checkpoint_dir import stored_tensors
    import math, torch
    own = sum(math.prod(v.size) * torch.empty((), dtype=v.properties.dtype).element_size()
              for v in stored_tensors(directory).values())
    disk = sum(p.stat().st_size for p in directory.iterdir())
    print(f"step=10.ckpt: {disk / 1e9:.2f} GB on disk, the state's tensors {own / 1e9:.2f} GB ({disk / own:.4f}x)")
if {"save", "resume"} <= clock.keys():
    uninterrupted = clock["save"]["losses"][10:]
    resumed = clock["resume"]["losses"]
    print("losses after step 10, uninterrupted:", [round(x, 4) for x in uninterrupted])
    print("losses after step 10, resumed:      ", [round(x, 4) for x in resumed])
    print("resumed losses equal:", uninterrupted == resumed,
          f"max difference {max(abs(a - b) for a, b in zip(uninterrupted, resumed)):.2e}")
PY
        ;;
    *)
        echo "unknown stage $stage (save, nosave, resume, eight_b, eight_b_twice, summary)"; exit 2
        ;;
    esac
done
cat "$OUT/summary.txt"
