# Sourced by the .ci/gpu_*.sh scripts from the repository root, with OUT_NAME set: what every GPU stage script needs.

OUT=${OUT:-$PWD/$OUT_NAME}  # logs, junit xml and tables; ./$OUT_NAME without OUT
mkdir -p "$OUT"

# The GPU image lacks jsonargparse[signatures] (train.py's LightningCLI) and datasets: wheels in .whl/, made by
# .ci/gpu_wheels.sh. Without them every stage would fail at its first import, after minutes: stop here instead.
if ! python -c "import docstring_parser, typeshed_client, datasets" 2>/dev/null; then
    python -m pip install --quiet --no-index --find-links .whl "jsonargparse[signatures]" datasets || {
        echo "error: jsonargparse[signatures] and datasets are not installed and .whl/ cannot install them: run" \
            ".ci/gpu_wheels.sh here and carry .whl"
        exit 3
    }
fi

record_versions() {  # torch, NCCL and the GPUs into $OUT/versions.txt
    python -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), \
torch.cuda.device_count(), 'x', torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
}

run() {  # run STAGE_NAME SECONDS COMMAND...: log to $OUT/STAGE_NAME.log, print the wall time
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    timeout -k 60 "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1  # -k: killed if still running 60 s after SIGTERM (its crash save)
    local code=$?
    echo "== $name: exit $code after $((SECONDS - start)) s wall" | tee -a "$OUT/summary.txt"
}

bundle_if_many() {  # bundle_if_many DIR: the device tool brings back at most 8 files; past that, one tar of them all
    local dir=$1
    if [ "$(find "$dir" -type f | wc -l)" -gt 8 ]; then
        tar -C "$dir" -cf /tmp/results.tar . && find "$dir" -mindepth 1 -delete && mv /tmp/results.tar "$dir/"
        echo "more than 8 files: bundled into $dir/results.tar"
    fi
}
