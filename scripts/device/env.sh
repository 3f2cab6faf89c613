# Sourced at the start of every device call: installs the carried wheels and points Python at this
# checkout as `verl_moe` (PYTHONSAFEPATH: the repo's ./verl_moe stub must not shadow the package).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl .whl/align/*.whl $(ls .whl/veomni/*.whl 2>/dev/null) || exit 1
mkdir -p /tmp/pkg/verl_moe && cp verl_moe/__init__.py /tmp/pkg/verl_moe/
for d in ops models engines tools configs; do ln -sfn "$PWD/$d" "/tmp/pkg/verl_moe/$d"; done
# scripts/device/stub: an import-only `ray` (verl imports it; its wheel is larger than the carry limit)
export PYTHONPATH=/tmp/pkg:/tmp/site:$PWD/scripts/device/stub PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 FLA_FLASH_QLA=0
python3 -c "import sys, torch, triton, transformers; print(sys.version.split()[0], torch.__version__, triton.__version__, transformers.__version__)" | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/env.txt"
