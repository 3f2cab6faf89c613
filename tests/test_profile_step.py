"""`benchmarks/profile_step.py::host_gaps` on a hand-made profiler timeline: each idle interval of the device is put
down to the host's sync, allocator call or launching op, as the timeline says."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "profile_step.py"


def _load():
    spec = importlib.util.spec_from_file_location("profile_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}


def test_host_gaps_by_cause():
    trace = {
        "traceEvents": [
            # kernel 1 runs 0-10; the host reads a value back (item -> a sync) at 5-15, then launches kernel 2
            _x("kernel", "k1", 0, 10, correlation=1),
            _x("cpu_op", "aten::item", 4, 12),
            _x("cuda_runtime", "cudaStreamSynchronize", 5, 5),
            _x("cuda_runtime", "cudaLaunchKernel", 16, 1, correlation=2),
            _x("kernel", "k2", 20, 10, correlation=2),  # idle 10-20: sync
            # the allocator between kernel 2 and 3
            _x("cpu_op", "aten::empty", 31, 6),
            _x("cuda_runtime", "cudaMalloc", 32, 4),
            _x("cuda_runtime", "cudaLaunchKernel", 38, 1, correlation=3),
            _x("kernel", "k3", 40, 5, correlation=3),  # idle 30-40: allocator
            # host work before the launch of kernel 4 (an op inside a module's forward), on the autograd thread
            _x("cpu_op", "Experts.forward", 40, 30, tid=2),
            _x("cpu_op", "aten::mm", 60, 5, tid=2),
            _x("cuda_runtime", "cudaLaunchKernel", 61, 1, tid=2, correlation=4),
            _x("kernel", "k4", 64, 10, correlation=4),  # idle 45-64: launch
            _x("kernel", "k5", 75, 10, correlation=5),  # idle 1 us: below the threshold
        ]
    }
    gaps = _load().host_gaps(trace)
    assert gaps == [
        ("launch: aten::mm in Experts.forward", pytest.approx(0.019), 1),
        ("sync: aten::item", pytest.approx(0.010), 1),
        ("allocator: aten::empty", pytest.approx(0.010), 1),
    ]
    # with Python stacks: our innermost frame at the sync and at a launch outside aten ops (a Triton wrapper)
    trace["traceEvents"] += [
        _x("python_function", "/repo/models/layers.py(10): forward", 0, 20),
        _x("python_function", "/repo/ops/experts/mlp.py(40): route", 3, 14),
        _x("python_function", "/site/torch/nn/module.py(1): _call_impl", 4, 13),
        _x("cuda_runtime", "cuLaunchKernel", 80, 1, correlation=6),
        _x("python_function", "/repo/ops/gdn/chunk.py(7): forward", 79, 3),
        _x("kernel", "chunk_fwd_kernel", 90, 5, correlation=6),  # idle 85-90: a launch outside aten ops
    ]
    gaps = _load().host_gaps(trace, package_root="/repo")
    assert gaps == [
        ("launch: aten::mm in Experts.forward", pytest.approx(0.019), 1),
        ("sync: aten::item at ops/experts/mlp.py(40): route", pytest.approx(0.010), 1),
        ("allocator: aten::empty", pytest.approx(0.010), 1),
        ("launch: chunk_fwd_kernel (outside aten ops) at ops/gdn/chunk.py(7): forward", pytest.approx(0.005), 1),
    ]
