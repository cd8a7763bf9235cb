# Sourced by the .ci/gpu_*.sh scripts (with $OUT set): what every GPU stage script needs.

# The GPU image lacks jsonargparse[signatures] (train.py's LightningCLI) and datasets: wheels in .whl/.
if [ -d .whl ] && ! python -c "import docstring_parser, typeshed_client" 2>/dev/null; then
    python -m pip install --quiet --no-index --find-links .whl "jsonargparse[signatures]" datasets
fi

run() {  # run STAGE_NAME SECONDS COMMAND...: log to $OUT/STAGE_NAME.log, print the wall time
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    timeout "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1
    local code=$?
    echo "== $name: exit $code after $((SECONDS - start)) s wall" | tee -a "$OUT/summary.txt"
}
