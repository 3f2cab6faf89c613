"""Device layer, dispatch and varlen checks."""

import numpy as np
import pytest
import torch
from verl_moe.ops import device, dispatch, varlen
from verl_moe.ops.compare import assert_rel_rms, rel_rms
from verl_moe.ops.varlen import check_cu_seqlens, seq_bounds


def test_device_answers_are_consistent():
    kind = device.device_type()
    assert kind in ("cuda", "npu", "cpu")
    assert device.dist_backend() == {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}[kind]
    assert device.device_module() is getattr(torch, kind)
    assert device.current_device().type == kind
    stats = device.memory_stats()
    assert set(stats) == {"allocated_gib", "reserved_gib", "max_allocated_gib"}


def test_forced_device_rejects_unknown(monkeypatch):
    device.device_type.cache_clear()
    monkeypatch.setenv("VERL_MOE_DEVICE", "tpu")
    try:
        with pytest.raises(ValueError, match="VERL_MOE_DEVICE"):
            device.device_type()
    finally:
        monkeypatch.delenv("VERL_MOE_DEVICE")
        device.device_type.cache_clear()


def test_dispatch_defaults_to_reference_on_cpu(monkeypatch):
    monkeypatch.delenv("VERL_MOE_OPS", raising=False)
    from verl_moe.ops.gdn.reference import chunk_gated_delta_rule_ref

    if not device.is_accelerator():
        assert dispatch.resolve("gdn") is chunk_gated_delta_rule_ref


def test_dispatch_is_loud(monkeypatch):
    with pytest.raises(ValueError, match="choices"):
        dispatch.resolve("gdn", "no-such-impl")
    with pytest.raises(ModuleNotFoundError):
        dispatch.resolve("no_such_op")
    monkeypatch.setenv("VERL_MOE_OPS", "gdn=no-such-impl")
    with pytest.raises(ValueError, match="no implementation 'no-such-impl'"):
        dispatch.resolve("gdn")


def test_dispatch_follows_env_changes(monkeypatch):
    """VERL_MOE_OPS is read on every resolve, not frozen by the first call's choice."""
    from verl_moe.ops.norm.reference import rms_norm_ref

    monkeypatch.setenv("VERL_MOE_OPS", "norm=torch")
    assert dispatch.resolve("norm") is rms_norm_ref
    monkeypatch.setenv("VERL_MOE_OPS", "norm=no-such-impl")
    with pytest.raises(ValueError, match="no implementation 'no-such-impl'"):
        dispatch.resolve("norm")


def test_public_ops_resolve_through_dispatch(monkeypatch):
    """Every public op calls `resolve` (none binds its reference to the public name), so a kernel
    registered in IMPLS cannot be skipped: an unknown choice in VERL_MOE_OPS reaches each of them."""
    import verl_moe.ops as ops

    x = torch.randn(1, 4, 2, 8)
    calls = {
        "norm": lambda: ops.rms_norm(x, torch.zeros(8)),
        "rope": lambda: ops.apply_rotary_pos_emb(x, x, torch.ones(1, 4, 8), torch.zeros(1, 4, 8)),
        "attention": lambda: ops.causal_attention(x, x, x),
        "conv1d": lambda: ops.causal_conv1d(x[0], torch.ones(2, 4)),
        "router": lambda: ops.route(x[0, 0], torch.randn(4, 8), 2, True),
        "experts": lambda: ops.moe_experts(x[0, 0], torch.randn(2, 4, 8), torch.randn(2, 8, 2), None, None),
        "gdn": lambda: ops.chunk_gated_delta_rule(x, x, x, x[..., 0], x[..., 0]),
        "logprob": lambda: ops.logprobs_and_entropy(x[0, 0], torch.randn(5, 8), torch.zeros(2, dtype=torch.long)),
    }
    for op, call in calls.items():
        monkeypatch.setenv("VERL_MOE_OPS", f"{op}=no-such-impl")
        with pytest.raises(ValueError, match="no implementation 'no-such-impl'"):
            call()


def test_dispatch_refuses_unrunnable_anchor(monkeypatch):
    if device.device_type() == "cuda":
        pytest.skip("fla may run on cuda")
    with pytest.raises(ValueError, match="cannot run here"):
        dispatch.resolve("gdn", "fla")


@pytest.mark.parametrize(
    "cu, total, message",
    [
        ([1, 3], 3, "start at 0"),
        ([0, 3, 2, 4], 4, "non-decreasing"),
        ([0, 3], 4, "ends at 3"),
        ([0.0, 3.0], 3, "int32 or int64"),
    ],
)
def test_bad_cu_seqlens_raise(cu, total, message):
    with pytest.raises(ValueError, match=message):
        check_cu_seqlens(torch.tensor(cu), total)


def test_seq_bounds():
    assert seq_bounds(torch.tensor([0, 1, 4]), 4) == [(0, 1), (1, 4)]
    assert seq_bounds(None, 5) == [(0, 5)]


class CountedOffsets(torch.Tensor):
    """Offsets whose host reads are counted (CPU CI: the reads a device tensor would cost)."""

    reads: list = []

    def tolist(self):
        CountedOffsets.reads.append(1)
        return torch.Tensor(self).tolist()


def _counted(values) -> torch.Tensor:
    CountedOffsets.reads = []
    return torch.tensor(values, dtype=torch.int32).as_subclass(CountedOffsets)


def test_host_copy_of_offsets_spares_the_device_read():
    """With `cu_seqlens_cpu` the offsets are read from the host copy, never from `cu_seqlens`;
    without it each call reads `cu_seqlens` (no cache to go stale); a host copy of another length
    is refused."""
    cu, host = _counted([0, 3, 7]), torch.tensor([0, 3, 7], dtype=torch.int32)
    assert seq_bounds(cu, 7, host) == [(0, 3), (3, 7)]
    assert check_cu_seqlens(cu, 7, host) == [0, 3, 7]
    assert varlen.host_offsets(cu, host) is host
    assert not CountedOffsets.reads
    assert seq_bounds(cu, 7) == [(0, 3), (3, 7)] and len(CountedOffsets.reads) == 1
    assert varlen.host_offsets(cu, None) == (0, 3, 7) and len(CountedOffsets.reads) == 2
    assert check_cu_seqlens(cu, 7, (0, 3, 7)) == [0, 3, 7] and len(CountedOffsets.reads) == 2  # ints serve too
    with pytest.raises(ValueError, match="host copy"):
        check_cu_seqlens(cu, 7, host[:2])


def test_ops_read_the_host_copy():
    """The sequence ops (torch references) take the host copy and then never read `cu_seqlens`; the
    results equal those from `cu_seqlens` alone."""
    import verl_moe.ops as ops

    x = torch.randn(1, 7, 2, 8)
    g, beta = -x[..., 0].abs(), x[..., 0].sigmoid()
    host = torch.tensor([0, 3, 7], dtype=torch.int32)

    def run(**offsets):
        return (
            ops.causal_attention(x, x, x, impl="torch", **offsets),
            ops.causal_conv1d(x[..., 0, :], torch.ones(8, 4), impl="torch", **offsets),
            ops.chunk_gated_delta_rule(x, x, x, g, beta, impl="torch", **offsets)[0],
        )

    from_device = run(cu_seqlens=host.clone())
    cu = _counted([0, 3, 7])
    from_host = run(cu_seqlens=cu, cu_seqlens_cpu=host)
    assert not CountedOffsets.reads
    for a, b in zip(from_device, from_host):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_offsets_follow_writes_that_keep_the_version(dtype):
    """A numpy-backed buffer rewritten through numpy keeps its torch version counter: the offsets
    read afterwards are its current content, and an invalid rewrite is refused."""
    buffer = np.array([0, 3, 10], dtype=dtype)
    cu = torch.from_numpy(buffer)
    assert seq_bounds(cu, 10) == [(0, 3), (3, 10)]
    check_cu_seqlens(cu, 10)
    version = cu._version
    buffer[1] = 5
    assert cu._version == version
    assert varlen.host_values(cu) == buffer.tolist()
    assert seq_bounds(cu, 10) == [(0, 5), (5, 10)]
    buffer[2] = 99
    with pytest.raises(ValueError, match="ends at 99"):
        check_cu_seqlens(cu, 10)


def test_rel_rms_catches_nan_and_error():
    ref = torch.ones(8)
    assert rel_rms(ref, ref) == 0.0
    with pytest.raises(AssertionError, match="non-finite"):
        assert_rel_rms("x", ref, torch.full((8,), float("nan")), 1.0)
    with pytest.raises(AssertionError, match="rel_rms"):
        assert_rel_rms("x", ref, ref * 1.1, 1e-3)


def test_public_ops_import_without_triton():
    """`import verl_moe.ops` exposes every public op and leaves Triton unimported (kernels load lazily)."""
    import subprocess
    import sys

    code = (
        "import sys, verl_moe.ops as ops; missing = [n for n in ops.__all__ if not callable(getattr(ops, n))];"
        "assert not missing, missing; assert 'triton' not in sys.modules, 'triton imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
