#!/usr/bin/env bash
# For a GPU machine without internet: fetch this package's wheel and every wheel the benchmarks need into DIR
# (run it on a machine with internet, the same Python version and the same platform). It only fetches. On the
# offline machine:
#   pip install --no-index --find-links DIR 'verl-moe[bench,megatron,test]'
#   pip install --no-index --find-links DIR --no-deps veomni blobfile tiktoken einops
set -euo pipefail
DIR=${1:?usage: bash benchmarks/download_wheels.sh DIR}
cd "$(dirname "$0")/.."
# ours as a wheel, its dependencies and the extras' (sdist-only ones, e.g. hydra's antlr4 runtime, built here)
python -m pip wheel -w "$DIR" '.[bench,megatron,test]'
# VeOmni without its declared dependencies (they pull another torch); it imports with verl's plus these
python -m pip download -d "$DIR" --no-deps veomni==0.1.12 blobfile tiktoken einops
