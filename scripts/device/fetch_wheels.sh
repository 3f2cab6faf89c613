#!/usr/bin/env bash
# Fill the git-ignored .whl/ folder with what the H200 device machine lacks (it has torch 2.11,
# Triton 3.6, transformers 5.17, Python 3.12 and no internet). Run here, then pass carry=[".whl"].
set -euo pipefail
cd "$(dirname "$0")/../.."
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d "$1" "${@:2}"; }
get .whl fla-core==0.6.0 liger-kernel==0.8.5                     # benchmark anchors
# hydra's antlr4 runtime 4.9.3 exists only as an sdist: build its (pure Python) wheel here
python3 -m pip wheel -q --no-deps -w .whl/align antlr4-python3-runtime==4.9.3
get .whl/align megatron-core==0.19.2 verl==0.9.1 tensordict==0.10.0 omegaconf==2.3.1 hydra-core==1.3.2 \
  codetiming==1.4.0 datasets==5.2.0 multiprocess==0.70.19 dill==0.4.1 \
  orjson==3.13.0 pyvers==0.1.0                                    # the align tool's imports
# optional, for the veomni backend on the GPU (its imports on the device are not verified yet)
get .whl/veomni veomni==0.1.12 blobfile==3.3.0 tiktoken==0.14.0 einops==0.8.2
ls -la .whl .whl/align .whl/veomni
