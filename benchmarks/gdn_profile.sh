#!/usr/bin/env bash
# Per-kernel CUDA time of our GDN kernels and of fla's, same process, same inputs (B=1, T=16384 by default;
# CASES= picks others from tools/bench/ops/gdn.py), then the configs our autotuner picked. Needs
# `pip install '.[bench]'` and a CUDA GPU; fla's first call autotunes for minutes. Prints to the terminal.
set -euo pipefail
export FLA_FLASH_QLA=0
python -m verl_moe.tools.bench.gdn_profile triton,fla "${CASES:-B1-T16384-H16-HV32}"
