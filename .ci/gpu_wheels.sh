#!/usr/bin/env bash
# The wheels the GPU image lacks, into .whl/ (git-ignored) for the device tool to carry (`carry: [".whl"]`):
# jsonargparse[signatures] (train.py's LightningCLI) and datasets, with every dependency, for the image's Python
# 3.12 on x86-64 Linux. numpy, pandas and pyarrow are left out: the image has them, and pyarrow alone (55 MB) would
# not fit the carry's 64 MiB. .ci/gpu_stages.sh installs from .whl/ with --no-index, keeping what the image has
# where it satisfies the requirements, so a dependency missing here fails a stage at its first import: on
# 2026-12-02 two calls were lost that way (fsspec, then importlib_resources), hence the whole tree.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir .whl
pip download --quiet --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "jsonargparse[signatures]==4.53.0" "datasets==4.4.1"
rm -f .whl/numpy-* .whl/pandas-* .whl/pyarrow-*
echo "$(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/"
