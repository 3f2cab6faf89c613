"""Exact mode end to end on CPU: our rollout's log-prob of every response token equals the trainer's (the packed
forward + log-prob head, however the micro-batches are packed), bitwise, for both model families in bf16 and
fp32; and each op switched back to its fast form breaks that. Each check runs `exact_check.py` in a process
started with ATEN_CPU_CAPABILITY=default, as exact mode requires on CPU.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import verl_moe.models as vm
from tiny_models import tiny_qwen3_moe

CHECK = os.path.join(os.path.dirname(__file__), "exact_check.py")


def _run(family: str, dtype: str, *switched: str, device: str = "cpu") -> list[dict]:
    env = dict(os.environ)
    if device == "cpu":  # a process that sees a GPU resolves its ops for it: the cpu check hides it
        env.update(ATEN_CPU_CAPABILITY="default", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(
        [sys.executable, CHECK, "--device", device, family, dtype, *switched],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_moe"])
def test_rollout_log_probs_equal_the_trainers_bitwise(family, dtype):
    """18 requests (prompts of 1-13 tokens, the longer ones prefilled in chunks of 8; two arrival waves;
    temperatures 1 and 0.7) through the rollout engine; the same sequences packed three ways as the trainer's
    micro-batches: every response token's log-prob equal."""
    (result,) = _run(family, dtype)
    assert result["tokens"] > 250
    assert result["mismatched"] == 0, result


# Per family, the ops whose fast form shows at these shapes (the rest coincide there with the exact form).
SWITCHED = {
    "qwen3_5_moe": [
        "linear",
        "logits",
        "attention",
        "attention_decode",
        "gdn",
        "gdn_step",
        "conv1d",
        "experts",
        "sampling",
        "logprob",
    ],
    "qwen3_moe": ["attention_cached", "router"],
}
# Ops whose fast cpu form is the BLAS library's GEMM, whose kernel (and so whether a row's sum depends on the
# rows beside it) the library picks by CPU model: on some CPUs the router's shows, on others it computes the
# tiny model's rows alike in every batch. Reported, not required to show; the others must.
BLAS_ON_CPU = {"router"}


@pytest.mark.parametrize("family", sorted(SWITCHED))
def test_each_op_back_in_its_fast_form_breaks_equality(family):
    """The same check in fp32 with one op at a time in its fast (cpu) form: some token's log-probs differ."""
    exact, *switched = _run(family, "fp32", *SWITCHED[family])
    assert exact["mismatched"] == 0, exact
    assert [r["switched"] for r in switched] == SWITCHED[family]
    unaffected = [r["switched"] for r in switched if r["mismatched"] == 0 and r["switched"] not in BLAS_ON_CPU]
    assert not unaffected, f"ops whose fast form still matched: {unaffected}"
    assert any(r["mismatched"] > 0 for r in switched), switched


# On the GPU the fast forms differ from the exact ones at every op that reduces, but at tiny shapes some
# compute the same numbers (Qwen3-MoE's fast logits and log-prob head differ there; its fast projections,
# attention, experts and router have computed the same numbers): the test asks that at least one listed op shows.
SWITCHED_GPU = {
    "qwen3_5_moe": ["linear", "logits", "attention", "gdn", "gdn_step", "experts", "logprob"],
    "qwen3_moe": ["linear", "logits", "attention", "experts", "logprob"],
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_moe"])
def test_rollout_log_probs_equal_the_trainers_bitwise_on_gpu(family, dtype):
    """The same check on the GPU (the Triton exact forms); in bf16 also each op switched back to the device's
    fast form: some token's log-probs differ (reported per op; at least one op shows)."""
    exact, *switched = _run(family, dtype, *(SWITCHED_GPU[family] if dtype == "bf16" else ()), device="cuda")
    assert exact["tokens"] > 250
    assert exact["mismatched"] == 0, exact
    print(json.dumps(switched))
    assert not switched or any(r["mismatched"] > 0 for r in switched), switched


def test_exact_mode_refuses_torch_vector_kernels():
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("this process runs torch's scalar kernels: the refusal cannot show")
    with pytest.raises(ValueError, match="ATEN_CPU_CAPABILITY=default"):
        vm.build(tiny_qwen3_moe(), ops=vm.OpsConfig(exact=True))


def test_exact_mode_takes_no_op_choice():
    with pytest.raises(ValueError, match="leave gdn at auto"):
        vm.OpsConfig(exact=True, gdn="torch")
    with pytest.raises(ValueError, match="exact must be true or false"):
        vm.OpsConfig(exact="yes")
