"""The whole model on our kernels equals the model on the references.

Tiny Qwen3.5-MoE and Qwen3-MoE in fp32: every op that has a kernel runs it (Triton under
TRITON_INTERPRET=1 on CPU), the rest keep their torch code; the same weights on the torch references
are the golden. Tolerances (fp32): logits max |diff| <= 1e-4 against the references in fp32; each
parameter gradient within rel RMS 1e-4 of the fp64 references', or at most 10x the fp32 references'
own distance from fp64 (A_log's gradient, ~1e-8 where the decay saturates, is a sum over tokens that
cancels: the fp32 references are 0.5% off fp64 there). Packed input equals one forward per sequence.
The kernels read TRITON_INTERPRET when they are imported, so the comparison runs in a child pytest
with the variable set (as tests/ops/test_logprob.py does).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch
import verl_moe.models as vm
from tiny_models import tiny_qwen3_5_moe_text, tiny_qwen3_moe
from verl_moe.ops.compare import rel_rms

_CHILD_FLAG = "VERL_MOE_TEST_FUSED_MODEL_CHILD"
IN_CHILD = os.environ.get(_CHILD_FLAG) == "1"
LOGIT_TOL, GRAD_TOL = 1e-4, 1e-4
OPS = ("gdn", "norm", "rope", "conv1d", "attention", "router", "experts")
# The accelerated implementation of each op, in order of preference, where it has one.
PREFERRED = ("triton", "grouped")


def kernel_ops() -> vm.OpsConfig:
    """An OpsConfig choosing, per op, the first of PREFERRED its IMPLS holds (torch otherwise)."""
    choice = {}
    for op in OPS:
        impls = importlib.import_module(f"verl_moe.ops.{op}").IMPLS
        choice[op] = next((name for name in PREFERRED if name in impls), "torch")
    return vm.OpsConfig(**choice)


def _step(model, ids, pos, cu):
    hidden = model(ids, pos, cu_seqlens=cu).last_hidden_state
    logits = model.logits(hidden)
    model.zero_grad(set_to_none=True)
    (logits.float().square().mean() + logits.float().mean()).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _pair(config, fp64: bool = False):
    """(references in fp32, kernels in fp32[, references in fp64]) with the same weights."""
    torch.manual_seed(0)
    torch_ops = vm.OpsConfig(**dict.fromkeys(OPS, "torch"))
    ref = vm.build(config, dtype=torch.float32, ops=torch_ops)
    fused = vm.build(config, dtype=torch.float32, ops=kernel_ops())
    fused.load_state_dict(ref.state_dict())
    if not fp64:
        return ref, fused
    ref64 = vm.build(config, dtype=torch.float64, ops=torch_ops)
    ref64.load_state_dict({k: v.double() for k, v in ref.state_dict().items()})
    return ref, fused, ref64


def _packed_batch(vocab: int, lengths: list[int]):
    T = sum(lengths)
    ids = torch.randint(1, vocab, (1, T))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return ids, pos, cu


if not IN_CHILD:

    def test_fused_model_in_interpreter():
        """This file's comparisons in a child process with TRITON_INTERPRET=1."""
        env = {**os.environ, "TRITON_INTERPRET": "1", _CHILD_FLAG: "1"}
        here = os.path.dirname(__file__)
        cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-m", "not gpu"]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=here)
        assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
        assert " passed" in proc.stdout

else:

    @pytest.mark.parametrize("make_config", [tiny_qwen3_5_moe_text, tiny_qwen3_moe], ids=["qwen3.5", "qwen3"])
    def test_kernels_equal_references(make_config):
        config = make_config()
        ref, fused, ref64 = _pair(config, fp64=True)
        # one length-1 sequence and one longer than a GDN chunk (64 tokens)
        ids, pos, cu = _packed_batch(config.vocab_size, [5, 1, 70])
        logits_ref, grads_ref = _step(ref, ids, pos, cu)
        logits, grads = _step(fused, ids, pos, cu)
        _, grads64 = _step(ref64, ids, pos, cu)
        assert (logits - logits_ref).abs().max().item() <= LOGIT_TOL
        assert grads.keys() == grads_ref.keys() == grads64.keys()
        for name, g in grads.items():
            bound = max(GRAD_TOL, 10 * rel_rms(grads64[name], grads_ref[name]))
            assert rel_rms(grads64[name], g) <= bound, name

    def test_packed_equals_per_sequence():
        config = tiny_qwen3_5_moe_text()
        _, fused = _pair(config)
        lengths = [7, 1, 66]
        ids, pos, cu = _packed_batch(config.vocab_size, lengths)
        packed = fused.logits(fused(ids, pos, cu_seqlens=cu).last_hidden_state)[0]
        start = 0
        for n in lengths:
            one = fused.logits(fused(ids[:, start : start + n], pos[:, start : start + n]).last_hidden_state)[0]
            assert (packed[start : start + n] - one).abs().max().item() <= LOGIT_TOL
            start += n
