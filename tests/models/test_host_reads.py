"""The training step reads no value back from the device.

On cuda a host read of a device tensor (`.item()`, `.tolist()`, `bool(t)`, `nonzero`, ...) waits for all
queued work, and the device then idles while the host launches again: every such read in the forward or the
backward is a hole in the step. Here, on CPU with the accelerator's op choices (the Triton kernels in the
interpreter), every op that reads a tensor's values on the host is recorded with the function of ours that
called it, through one training step as the engines run it: packed sequences with their host offsets, forward,
the log-prob head, backward. The only reads allowed are the input checks that run on the device on cuda
(`torch._assert_async`) and on the host elsewhere.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
import verl_moe.models as vm
from test_fused_model import kernel_ops
from tiny_models import packed_inputs, tiny_qwen3_5_moe_text, tiny_qwen3_moe
from torch.utils._python_dispatch import TorchDispatchMode
from verl_moe.ops.logprob import logprob_head

ROOT = Path(vm.__file__).resolve().parents[1]  # the package's source tree
# aten ops that read values back to the host (on cuda: a device sync)
READS = {"_local_scalar_dense", "is_nonzero", "nonzero", "equal", "masked_select", "_unique2", "bincount"}
TENSOR_READS = ("tolist", "item", "__bool__", "__int__", "__float__", "numpy")
# (file, function) of the checks that read on the host only off cuda
ALLOWED = {("ops/experts/reference.py", "check_experts_inputs"), ("ops/logprob/__init__.py", "_check_values")}


def _caller() -> tuple[str, str] | None:
    """(file relative to the package, function) of the innermost frame of ours, or None for a read made by the
    Triton interpreter (it moves kernel arguments through numpy) or outside our code."""
    frames = traceback.extract_stack()[:-2]
    if any("/triton/" in f.filename for f in frames):
        return None
    ours = [f for f in frames if f.filename.startswith(str(ROOT)) and "/tests/" not in f.filename]
    ours = [f for f in ours if ".venv" not in f.filename and "site-packages" not in f.filename]
    return (str(Path(ours[-1].filename).relative_to(ROOT)), ours[-1].name) if ours else None


class _Reads(TorchDispatchMode):
    def __init__(self, seen: dict):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in READS:
            where = _caller()
            if where is not None:
                self.seen.setdefault(where, set()).add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_moe"])
def test_training_step_reads_nothing_back(monkeypatch, family):
    config = tiny_qwen3_5_moe_text() if family == "qwen3_5_moe" else tiny_qwen3_moe()
    model = vm.build(config, dtype=torch.float32, ops=kernel_ops())
    ids, pos, cu = packed_inputs([5, 11, 8], vocab=config.vocab_size)
    seen: dict = {}
    for name in TENSOR_READS:
        real = getattr(torch.Tensor, name)

        def record(self, *args, _real=real, _name=name, **kwargs):
            where = _caller()
            if where is not None:
                seen.setdefault(where, set()).add(_name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, record)
    head = logprob_head("triton")
    with _Reads(seen):
        hidden = model(ids, pos, cu_seqlens=cu, cu_seqlens_cpu=tuple(cu.tolist())).last_hidden_state[0, :-1]
        labels = ids[0, 1:]
        log_prob, _ = head(hidden, model.lm_head.weight, labels, torch.ones(labels.shape[0]), calculate_entropy=False)
        (-log_prob.mean()).backward()
    assert model.lm_head.weight.grad is not None
    unexpected = {where: reads for where, reads in seen.items() if where not in ALLOWED}
    assert not unexpected, f"host reads of device values in the training step: {unexpected}"
    # the allowed checks are seen: the recorder works
    assert ("ops/experts/reference.py", "check_experts_inputs") in seen
