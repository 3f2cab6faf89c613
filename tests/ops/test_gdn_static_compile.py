"""Register budget of the GDN kernels on the sequential path, by a static sm_90 compile (no GPU needed).

The state kernels walk a sequence's chunks one after another, so a spill there costs on every chunk;
their configs must compile without spills. Numbers are from this machine's Triton (pinned in
scripts/install.sh); the H200 runs its own Triton, whose allocation can differ.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from verl_moe.ops.gdn.static_compile import CUOBJDUMP

pytestmark = pytest.mark.skipif(
    not os.path.exists(CUOBJDUMP), reason="needs Triton's NVIDIA backend (ptxas, cuobjdump) to compile for sm_90"
)


@pytest.mark.parametrize(
    "kernel,overrides",
    [("_gdn_state_fwd_kernel", {}), ("_gdn_state_bwd_kernel", {}), ("_gdn_wy_fwd_kernel", {"STORE_AIB": True})],
)
def test_kernel_configs_do_not_spill(kernel, overrides):
    # In a fresh process without TRITON_INTERPRET (set for the other tests), so the kernels are JIT functions.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import json; from verl_moe.ops.gdn.static_compile import kernel_report; "
        f"print(json.dumps(kernel_report({kernel!r}, {overrides!r})))"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert rows
    spilling = [(config, usage) for config, usage in rows if usage["spill_bytes"] > 0]
    assert not spilling, f"{kernel} spills at sm_90: {spilling}"
    for _, usage in rows:
        assert 0 < usage["regs"] <= 255 and usage["smem_kib"] <= 227
