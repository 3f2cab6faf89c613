"""The rollout's device-graph runners (CUDA graphs, or torch_npu's NPUGraph): `DeviceGraphs` captures a function
of tensors that outlive it once per key and replays it; `StepGraphs` runs `MoeDecoder.step` (and the sampling
after it) through it, the speculative engine its rounds."""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from ...models.decode import MoeDecoder, SlotState
from ...ops import device

# captures this process has warmed up (what fixes their kernels' shapes): a later capture of the same finds its
# kernels compiled and autotuned and runs no eager step first (a fresh engine per RL step)
_WARMED: set[tuple] = set()


def graphs_by_default(decoder: MoeDecoder) -> bool:
    """Whether the rollout's engines run on device graphs when not told: the devices and dtypes
    tests/engines/test_decode_graphs.py covers (cuda, bf16 / fp32; npu opts in)."""
    return decoder.device.type == "cuda" and decoder.dtype in (torch.bfloat16, torch.float32)


class DeviceGraphs:
    """Functions captured once per key as device graphs in one memory pool and replayed: a call then costs one
    launch of host time instead of a few hundred.

    A function may only read and write tensors that outlive its graph (the caller refills them before each
    call) and its outputs are consumed before the next call (the graphs share one pool, so outputs may alias).
    Capturing runs the function eagerly first (kernel selection and autotuning happen there, not in the graph:
    twice the first time this process captures its signature, not at all after) with `idle`, the caller's
    tensor of activity flags, zeroed: the function must then change nothing, so capturing at any time leaves
    the caller's state as it was.
    """

    def __init__(self, dev: torch.device):
        module = device.device_module()
        graph_class = getattr(module, "CUDAGraph", None) or getattr(module, "NPUGraph", None)
        if graph_class is None or not device.is_accelerator(dev):
            raise ValueError(f"device graphs need a cuda or npu model, got {dev}")
        self.module, self.graph_class = module, graph_class
        self.graphs: dict[Hashable, tuple] = {}  # key -> (graph, outputs)
        self.pool = None

    def run(self, key: Hashable, fn: Callable, idle: torch.Tensor, signature: tuple):
        """fn() through the graph captured for `key` (captured now if there is none): its outputs.
        `signature`: what fixes the kernels' shapes (a capture with a signature this process has warmed up
        runs no eager step)."""
        if key not in self.graphs:
            self.graphs[key] = self._capture(fn, idle, signature)
        graph, outputs = self.graphs[key]
        graph.replay()
        return outputs

    def clear(self) -> None:
        """Forget every graph (the tensors they read were reallocated) and their memory pool: the allocator
        retires a pool whose graphs are all gone, and a capture into it then fails (CUDA: "use_count > 0
        INTERNAL ASSERT FAILED"); the next capture opens a new one."""
        self.graphs, self.pool = {}, None

    def _capture(self, fn: Callable, idle: torch.Tensor, signature: tuple):
        saved = idle.clone()
        idle.zero_()
        stream = self.module.Stream()
        stream.wait_stream(self.module.current_stream())
        with self.module.stream(stream):
            for _ in range(0 if signature in _WARMED else 2):
                fn()
        _WARMED.add(signature)
        self.module.current_stream().wait_stream(stream)
        if self.pool is None:
            self.pool = self.module.graph_pool_handle()
        graph = self.graph_class()
        with self.module.graph(graph, pool=self.pool):
            outputs = fn()
        idle.copy_(saved)
        return graph, outputs


class StepGraphs:
    """`MoeDecoder.step` (and what the caller does with its logits) captured once per (batch size, key, state
    version) as a device graph (`DeviceGraphs`), replayed on the same input buffers.

    The caller keeps `tokens` and `active` in persistent buffers (their slices [0, B) are what a graph reads)
    and consumes the returned outputs before the next call. Capturing runs with every slot inactive.
    """

    def __init__(self, decoder: MoeDecoder):
        self.decoder = decoder
        self.runner = DeviceGraphs(decoder.device)
        self.version: int | None = None

    @property
    def graphs(self) -> dict:
        return self.runner.graphs

    def step(self, tokens: torch.Tensor, state: SlotState, active: torch.Tensor, then=None, key=None):
        """As `MoeDecoder.step(tokens, state, active)`, or `then(logits)` of it, through the graph
        captured for (len(tokens), key). `then` runs inside the graph: it may only read and write
        tensors that outlive the graph, must leave inactive rows as they are, and is captured once
        per key: the caller gives a new key (or calls `clear`) when what it would do changes."""
        if state.version != self.version:  # reallocated tensors: the old graphs read freed memory
            self.clear()
            self.version = state.version

        def run():
            logits = self.decoder.step(tokens, state, active)
            return logits if then is None else then(logits)

        shapes = tuple(tuple(t.shape) for cache in state.layers for t in vars(cache).values())
        signature = ("step", tokens.numel(), key, self.decoder.dtype, shapes)
        return self.runner.run((tokens.numel(), key), run, active, signature)

    def clear(self) -> None:
        """Forget every graph (the tensors a `then` reads were reallocated)."""
        self.runner.clear()


__all__ = ["DeviceGraphs", "StepGraphs", "graphs_by_default"]
