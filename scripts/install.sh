#!/usr/bin/env bash
# Install verl-moe and its CPU test dependencies into .venv from nothing (~3-5 min, no CUDA wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip install -q --upgrade pip "setuptools>=69" wheel
# torch first (the CPU wheel), then keep it fixed: anything that asks for torch would otherwise pull a CUDA build.
pip install -q torch==2.13.0
pip install -q -c scripts/constraints.txt "verl[verl-core]==0.9.1" "triton==3.9.0"
# VeOmni's declared deps pull timm -> torchvision -> a CUDA torch; it imports with what verl brings plus these.
pip install -q -c scripts/constraints.txt --no-deps "veomni==0.1.12"
pip install -q -c scripts/constraints.txt blobfile tiktoken einops matplotlib
# megatron-core (the align tool's megatron backend; its CPU tests): needs only torch, numpy, packaging.
pip install -q -c scripts/constraints.txt "megatron-core==0.16.1"
pip install -q -c scripts/constraints.txt --no-build-isolation -e ".[test]"
