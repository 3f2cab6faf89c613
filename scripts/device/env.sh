# Sourced at the start of every device call: installs the carried wheels and puts this checkout on
# PYTHONPATH: its ./verl_moe/__init__.py makes the repo root the `verl_moe` package (no install needed).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl .whl/align/*.whl $(ls .whl/veomni/*.whl 2>/dev/null) || exit 1
# scripts/device/stub: an import-only `ray` (verl imports it; its wheel is larger than the carry limit)
export PYTHONPATH=$PWD:/tmp/site:$PWD/scripts/device/stub PYTHONUNBUFFERED=1 FLA_FLASH_QLA=0
python3 -c "import sys, torch, triton, transformers; print(sys.version.split()[0], torch.__version__, triton.__version__, transformers.__version__)" | tee "$OUT/env.txt"
python3 -c "import verl_moe.ops as o, verl_moe.tools as t; print('verl_moe from', o.__file__, t.__file__)" | tee -a "$OUT/env.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/env.txt"
