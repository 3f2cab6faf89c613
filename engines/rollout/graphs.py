"""The rollout's device-graph runner: `MoeDecoder.step` (and the sampling after it) captured once per batch
size and replayed (CUDA graphs, or torch_npu's NPUGraph)."""

from __future__ import annotations

import torch

from ...models.decode import MoeDecoder, SlotState
from ...ops import device

# captures this process has warmed up (batch size, key, dtype and the slot tensors' shapes): a later engine capturing
# the same finds its kernels compiled and autotuned, and warms up with one eager step instead of two
_WARMED: set[tuple] = set()


class StepGraphs:
    """`MoeDecoder.step` (and what the caller does with its logits) captured once per (batch size,
    key, state version) as a device graph (CUDA graphs, or torch_npu's NPUGraph), replayed on the
    same input buffers: a decode step then costs one launch of host time instead of a few hundred.

    The caller keeps `tokens` and `active` in persistent buffers (their slices [0, B) are what a
    graph reads) and consumes the returned outputs before the next call (the graphs share one memory
    pool, so their outputs may alias). Capturing runs the step eagerly first (kernel selection and
    autotuning happen there, not in the graph: twice the first time this process captures the shape,
    once after) with every slot inactive, so capturing at any time leaves the slots as they were.
    """

    def __init__(self, decoder: MoeDecoder):
        module = device.device_module()
        graph_class = getattr(module, "CUDAGraph", None) or getattr(module, "NPUGraph", None)
        if graph_class is None or not device.is_accelerator(decoder.device):
            raise ValueError(f"device graphs need a cuda or npu model, got {decoder.device}")
        self.decoder, self.module, self.graph_class = decoder, module, graph_class
        self.graphs: dict[tuple, tuple] = {}  # (B, key) -> (graph, outputs)
        self.version: int | None = None
        self.pool = None

    def step(self, tokens: torch.Tensor, state: SlotState, active: torch.Tensor, then=None, key=None):
        """As `MoeDecoder.step(tokens, state, active)`, or `then(logits)` of it, through the graph
        captured for (len(tokens), key). `then` runs inside the graph: it may only read and write
        tensors that outlive the graph, must leave inactive rows as they are, and is captured once
        per key: the caller gives a new key (or calls `clear`) when what it would do changes."""
        if state.version != self.version:  # reallocated tensors: the old graphs read freed memory
            self.clear()
            self.version = state.version
        index = (tokens.numel(), key)
        if index not in self.graphs:
            self.graphs[index] = self._capture(tokens, state, active, then, key)
        graph, outputs = self.graphs[index]
        graph.replay()
        return outputs

    def clear(self) -> None:
        """Forget every graph (the tensors a `then` reads were reallocated) and their memory pool: the
        allocator retires a pool whose graphs are all gone, and a capture into it then fails (CUDA:
        "use_count > 0 INTERNAL ASSERT FAILED"); the next capture opens a new one."""
        self.graphs, self.pool = {}, None

    def _capture(self, tokens, state, active, then, key):
        def run():
            logits = self.decoder.step(tokens, state, active)
            return logits if then is None else then(logits)

        shapes = tuple(tuple(t.shape) for cache in state.layers for t in vars(cache).values())
        signature = (tokens.numel(), key, self.decoder.dtype, shapes)
        saved = active.clone()
        active.zero_()
        stream = self.module.Stream()
        stream.wait_stream(self.module.current_stream())
        with self.module.stream(stream):
            for _ in range(1 if signature in _WARMED else 2):
                run()
        _WARMED.add(signature)
        self.module.current_stream().wait_stream(stream)
        if self.pool is None:
            self.pool = self.module.graph_pool_handle()
        graph = self.graph_class()
        with self.module.graph(graph, pool=self.pool):
            outputs = run()
        active.copy_(saved)
        return graph, outputs


__all__ = ["StepGraphs"]
