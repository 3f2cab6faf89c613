"""Register budget of the GDN kernels on the sequential path, by a static sm_90 compile (no GPU needed).

The state kernels walk a sequence's chunks one after another, so a spill there costs on every chunk;
their configs must compile without spills. Numbers are from this machine's Triton (pinned in
scripts/install.sh); a GPU machine's own Triton build may allocate differently.
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


def _kernel_report(expr: str):
    """The JSON value of `expr` (an expression over static_compile's `kernel_report`), evaluated in a fresh
    process without TRITON_INTERPRET (set for the other tests), so the kernels are JIT functions."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"import json; from verl_moe.ops.gdn.static_compile import kernel_report; print(json.dumps({expr}))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "kernel,overrides",
    [("_gdn_state_fwd_kernel", {}), ("_gdn_state_bwd_kernel", {}), ("_gdn_wy_fwd_kernel", {"STORE_AIB": True})],
)
def test_kernel_configs_do_not_spill(kernel, overrides):
    rows = _kernel_report(f"kernel_report({kernel!r}, {overrides!r})")
    assert rows
    spilling = [(config, usage) for config, usage in rows if usage["spill_bytes"] > 0]
    assert not spilling, f"{kernel} spills at sm_90: {spilling}"
    for _, usage in rows:
        assert 0 < usage["regs"] <= 255 and usage["smem_kib"] <= 227


def test_first_configs_fit_shared_memory_in_fp32():
    """fp32 inputs and deterministic mode run each kernel's first config alone, so it must launch on
    sm_90 (227 KiB of shared memory per block) in an fp32 build, whose tiles are twice as large: e.g.
    the state backward at BV=32, 3 stages (a bf16 pick of the autotuner) needs 242 KiB there."""
    from verl_moe.ops.gdn import l2norm, output, solve, state, wy

    names = [name for module in (l2norm, solve, wy, state, output) for name in module.KERNEL_LAUNCHES]
    first = _kernel_report(f"{{n: kernel_report(n, fp32=True, first_only=True)[0] for n in {names!r}}}")
    assert set(first) == set(names)
    too_big = {n: row for n, row in first.items() if row[1]["smem_kib"] > 227}
    assert not too_big, f"first configs over sm_90 shared memory in fp32: {too_big}"
