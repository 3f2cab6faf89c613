"""Activation offload: what autograd saves at each decoder layer waits for backward in host memory.

`ActivationOffload(layers)` puts a pair of `torch.autograd.graph.saved_tensors_hooks` around the forward of
each offloaded decoder layer (module hooks, nothing patched), keyed by the layer:

- pack (forward): a saved tensor on the compute device that is not a parameter (nor a view of one) has its
  whole storage copied into a new host buffer (pinned on cuda / npu) on a side stream, once an event says the
  compute stream produced it; autograd keeps a handle (the storage's block plus the tensor's offset, sizes and
  strides) instead of the tensor. Tensors of one storage saved by one layer share one copy. Backward gets
  each tensor back with its original geometry in a storage of the original's size, so every backward kernel
  sees the layouts (strides, alignment) it sees without offload and runs the same operations: gradients are
  bitwise those without offload. (A compact copy changed strides, and CPU GEMMs pick their blocking by
  layout: the sums differed in the last bit on some CPUs.) Under per-layer activation checkpointing
  (`torch.distributed._composable.checkpoint`, applied before or after this) the tensors saved at a layer
  are its inputs, since the checkpoint's own hooks sit inside ours and keep nothing: the host then holds
  every layer's inputs and the device one layer's recompute. Without checkpointing the host holds
  everything each layer saved.
- the device copy is dropped once its copy to the host is done: at a later layer's start if the copy's
  event has completed, two offloaded layers later in any case, after the compute stream waits on the event
  (the allocator then hands the block to later compute work only after the copy read it).
- unpack (backward): a layer's first unpack copies its tensors back (unless prefetched) and prefetches the
  next `prefetch_layers` offloaded layers below it (backward runs the layers in reverse), on the side stream
  into device memory allocated on the compute stream, which waits on each copy's event before use. The top
  offloaded layers are prefetched when the gradient of the last layer's output arrives.
- a host buffer is freed only after the event of its last copy completed, also when autograd drops a
  handle whose copy is still in flight (`_retire`).
The last decoder layer keeps its saved tensors on the device: backward starts with it.

Streams and events come from `ops.device.device_module()` (`torch.cuda`, `torch.npu`, `torch.cpu`). On CPU the
device is the host: the copies are plain copies into fresh buffers, the streams and events are torch.cpu's
(synchronous) and the hook logic runs unchanged, so CPU tests check the path an accelerator takes.
"""

from __future__ import annotations

import bisect
import fnmatch
import functools
import threading
import weakref
from collections.abc import Sequence

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef

from ..ops import device

# _Block.state
_ON_DEVICE_AND_HOST = "copying"  # the original device storage is still held; its copy to the host was issued
_ON_HOST = "host"  # the device storage was dropped
_BACK = "back"  # on the device again (restored or never dropped) for backward


class _Block:
    """One offloaded device storage. storage: the device storage (the original until dropped, then the
    restored copy) or None; host: its bytes on the host ([nbytes] uint8) until released; copied: the event of
    the last copy that touched `host`; ready: the event the compute stream waits on before using `storage`."""

    __slots__ = ("owner", "pass_", "pos", "device", "storage", "host", "copied", "ready", "state", "__weakref__")

    def __init__(self, owner, pass_, pos, device, storage, host, copied):
        self.owner, self.pass_, self.pos, self.device = owner, pass_, pos, device
        self.storage, self.host, self.copied, self.ready = storage, host, copied, None
        self.state = _ON_DEVICE_AND_HOST

    def __del__(self):
        # autograd dropped the handle (graph freed, possibly before backward): the host buffer may still be
        # the target of a copy in flight
        if self.host is not None:
            self.owner._retire(self.copied, self.host)
            self.host = None


class _Saved:
    """What autograd holds instead of one offloaded tensor: its block and where the tensor sits in it."""

    __slots__ = ("block", "dtype", "offset", "size", "stride", "__weakref__")

    def __init__(self, block: _Block, tensor: torch.Tensor):
        self.block, self.dtype = block, tensor.dtype
        self.offset, self.size, self.stride = tensor.storage_offset(), tensor.size(), tensor.stride()

    def view(self, storage, device) -> torch.Tensor:
        """The tensor over `storage` (the block's device storage or its host bytes), original geometry."""
        return torch.empty(0, dtype=self.dtype, device=device).set_(storage, self.offset, self.size, self.stride)


class _Pass:
    """One forward's handles, by offloaded-layer position (weak: autograd owns them)."""

    def __init__(self):
        self.saved: dict[int, list[weakref.ref]] = {}  # position -> weak _Saved handles, in packing order
        self.blocks: dict[int, list[weakref.ref]] = {}  # position -> weak _Blocks
        self.copying: list[weakref.ref] = []  # blocks still holding their original device storage
        self.started: set[int] = set()  # positions whose backward began (their first unpack)
        # storage -> (weak block, position): a storage saved again (cos / sin go to every layer; q, k, v are
        # views of one projection)
        self.seen: dict[StorageWeakRef, tuple[StorageWeakRef, weakref.ref, int]] = {}


class ActivationOffload:
    """Offload the saved tensors of `layers[i]` for i in `offloaded` (default: every layer but the last; the
    last is always left out). `layers`: the decoder layers in forward order. `prefetch_layers`: offloaded
    layers copied back ahead of the one whose backward runs. `min_bytes`: smaller tensors stay on the device.
    Attach before `fully_shard` (its pre-forward hook, which unshards the parameters, must run before ours).

    Counters: `packed_tensors` / `packed_bytes` (since construction; bytes of the storages copied),
    `host_bytes` (host buffers alive now) and `peak_host_bytes`. Raises ValueError on a bad index or a
    negative prefetch depth.
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        offloaded: Sequence[int] | None = None,
        prefetch_layers: int = 1,
        min_bytes: int = 0,
    ):
        layers = list(layers)
        chosen = range(len(layers)) if offloaded is None else offloaded
        bad = [i for i in chosen if not 0 <= i < len(layers)]
        if bad:
            raise ValueError(f"offloaded layer indices {bad} are outside the {len(layers)} decoder layers")
        if prefetch_layers < 0:
            raise ValueError(f"prefetch_layers={prefetch_layers} must be >= 0")
        # decoder-layer index per position; the last layer's backward comes first, so it keeps its tensors
        self.layer_indices = tuple(sorted(set(chosen) - {len(layers) - 1}))
        self.prefetch_layers = prefetch_layers
        self.min_bytes = min_bytes
        self.packed_tensors = self.packed_bytes = self.host_bytes = self.peak_host_bytes = 0
        self._mod = device.device_module()
        self._device_type = device.device_type()
        self._pin = device.is_accelerator()
        self._side: object | None = None
        self._pass: _Pass | None = None
        self._active: list[tuple[nn.Module, saved_tensors_hooks]] = []
        self._retiring: list[tuple[object, torch.Tensor]] = []
        # _retire also runs from _Block.__del__ (autograd's thread, or a GC pass inside a locked section)
        self._lock = threading.RLock()
        for i, layer in enumerate(layers):
            # a layer's start drops earlier layers' device copies (also at the last layer, which keeps its own)
            pos = bisect.bisect_left(self.layer_indices, i)
            offloaded_here = i in self.layer_indices
            layer.register_forward_pre_hook(functools.partial(self._enter, pos, offloaded_here), prepend=True)
            if offloaded_here:
                layer.register_forward_hook(self._exit, always_call=True)
        if self.layer_indices:
            layers[-1].register_forward_hook(self._arm_prefetch)

    # ---- inspection (tests, bench) -------------------------------------------------------------

    def held(self, layer_index: int) -> list[torch.Tensor]:
        """The host copies the latest forward holds for decoder layer `layer_index` (not yet released)."""
        if self._pass is None or layer_index not in self.layer_indices:
            return []
        refs = self._pass.saved.get(self.layer_indices.index(layer_index), [])
        handles = [s for s in (r() for r in refs) if s is not None and s.block.host is not None]
        return [s.view(s.block.host.untyped_storage(), "cpu") for s in handles]

    def on_device(self, layer_index: int) -> int:
        """How many of decoder layer `layer_index`'s offloaded tensors the latest forward holds on the device."""
        if self._pass is None or layer_index not in self.layer_indices:
            return 0
        refs = self._pass.saved.get(self.layer_indices.index(layer_index), [])
        return sum(1 for s in (r() for r in refs) if s is not None and s.block.storage is not None)

    # ---- forward -------------------------------------------------------------------------------

    def _enter(self, pos: int, offloaded: bool, module: nn.Module, args) -> None:
        """Forward pre-hook of a decoder layer; `pos`: its position among the offloaded layers (that of
        the next offloaded one for a layer not offloaded)."""
        if not torch.is_grad_enabled() or _recomputing(module):
            return  # nothing is saved, or the checkpoint recomputes the layer in backward: its hooks rule
        if offloaded and (pos == 0 or self._pass is None):
            self._pass = _Pass()
            self._sweep()
        if self._pass is not None:
            self._drop_device_copies(self._pass, pos)
        if not offloaded:
            return
        params = set()
        for p in module.parameters():  # unsharded by now (FSDP's pre-forward hook runs first)
            local = p.to_local() if isinstance(p, DTensor) else p
            params.add(local.untyped_storage().data_ptr())
        hooks = saved_tensors_hooks(functools.partial(self._pack, self._pass, pos, params), _unpack)
        hooks.__enter__()
        self._active.append((module, hooks))

    def _exit(self, module: nn.Module, args, output) -> None:
        if self._active and self._active[-1][0] is module:
            self._active.pop()[1].__exit__(None, None, None)

    def _arm_prefetch(self, module: nn.Module, args, output) -> None:
        """After the last layer's forward: its output's gradient hook starts the copy back of the top
        offloaded layers, so they arrive while the last layer's backward runs."""
        if not torch.is_grad_enabled() or _recomputing(module) or self._pass is None:
            return
        outputs = output if isinstance(output, tuple) else (output,)
        first = next((t for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if first is not None:
            first.register_hook(functools.partial(self._backward_starts, self._pass))

    def _backward_starts(self, pass_: _Pass, grad) -> None:
        top = len(self.layer_indices) - 1
        for pos in range(top, top - self.prefetch_layers, -1):
            self._fetch_layer(pass_, pos)

    def _offloadable(self, tensor, params: set) -> bool:
        return (
            type(tensor) is torch.Tensor  # not a Parameter, DTensor or other subclass
            and tensor.layout == torch.strided
            and tensor.device.type == self._device_type
            and tensor.numel() > 0
            and tensor.numel() * tensor.element_size() >= self.min_bytes
            # a leaf that requires grad is the caller's (held anyway); a view made without grad inside a
            # custom Function's forward of what became its output also reads as such a leaf: its _base
            # tells it apart
            and not (tensor.requires_grad and tensor.is_leaf and tensor._base is None)
            and not isinstance(tensor._base, nn.Parameter)  # a view of a weight (a transpose, an expert's slice)
            and tensor.untyped_storage().data_ptr() not in params
        )

    def _side_stream(self):
        if self._side is None:
            self._side = self._mod.Stream()
        return self._side

    def _pack(self, pass_: _Pass, pos: int, params: set, tensor):
        if not self._offloadable(tensor, params):
            return tensor
        storage = tensor.untyped_storage()
        key = StorageWeakRef(storage)
        seen = pass_.seen.get(key)
        if seen is not None and not seen[0].expired():
            # saved before in this forward: by this layer, share its copy; by an earlier one, the storage lives
            # on the device anyway (this tensor holds it), so a second copy would free nothing
            block = seen[1]() if seen[2] == pos else None
            if block is None or block.state != _ON_DEVICE_AND_HOST:
                return tensor
            return self._handle(pass_, pos, block, tensor)
        mod, side = self._mod, self._side_stream()
        produced = mod.Event()
        produced.record(mod.current_stream())
        host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=self._pin)
        side.wait_event(produced)
        with mod.stream(side):
            host.copy_(torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage), non_blocking=self._pin)
        copied = mod.Event()
        copied.record(side)
        block = _Block(self, pass_, pos, tensor.device, storage, host, copied)
        pass_.seen[key] = (key, weakref.ref(block), pos)
        pass_.blocks.setdefault(pos, []).append(weakref.ref(block))
        pass_.copying.append(weakref.ref(block))
        with self._lock:
            self.packed_bytes += host.numel()
            self.host_bytes += host.numel()
            self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        return self._handle(pass_, pos, block, tensor)

    def _handle(self, pass_: _Pass, pos: int, block: _Block, tensor) -> _Saved:
        saved = _Saved(block, tensor)
        pass_.saved.setdefault(pos, []).append(weakref.ref(saved))
        with self._lock:
            self.packed_tensors += 1
        return saved

    def _drop_device_copies(self, pass_: _Pass, pos: int) -> None:
        """At offloaded layer `pos`'s start: drop the device tensors of earlier layers whose copy to the host
        is done, and of layers two or more positions back after the compute stream waits for their copy."""
        still = []
        for ref in pass_.copying:
            block = ref()
            if block is None or block.state != _ON_DEVICE_AND_HOST:
                continue
            if block.pos < pos and block.copied.query():
                block.storage = None
            elif block.pos <= pos - 2:
                self._mod.current_stream().wait_event(block.copied)
                block.storage = None
            else:
                still.append(ref)
                continue
            block.state = _ON_HOST
        pass_.copying = still

    # ---- backward ------------------------------------------------------------------------------

    def _restore(self, saved: _Saved) -> torch.Tensor:
        block = saved.block
        pass_ = block.pass_
        if block.pos not in pass_.started:
            pass_.started.add(block.pos)
            # this layer's tensors first (stream order), then the next layers backward reaches
            for pos in range(block.pos, block.pos - self.prefetch_layers - 1, -1):
                self._fetch_layer(pass_, pos)
            self._sweep()
        if block.state == _ON_HOST:  # packed after its layer's first unpack (not expected): fetch it now
            self._fetch(block)
        if block.ready is not None:
            self._mod.current_stream().wait_event(block.ready)
            block.ready = None
        block.state = _BACK
        if block.host is not None:
            self._retire(block.copied, block.host)
            block.host = None
        return saved.view(block.storage, block.device)

    def _fetch_layer(self, pass_: _Pass, pos: int) -> None:
        for ref in pass_.blocks.get(pos, []):
            block = ref()
            if block is not None and block.state == _ON_HOST:
                self._fetch(block)

    def _fetch(self, block: _Block) -> None:
        """Copy `block.host` back on the side stream into memory allocated on the compute stream."""
        mod, side = self._mod, self._side_stream()
        compute = mod.current_stream()
        buffer = torch.empty(block.host.shape, dtype=torch.uint8, device=block.device)
        allocated = mod.Event()
        allocated.record(compute)  # the block may come from compute work still running
        side.wait_event(allocated)
        with mod.stream(side):
            buffer.copy_(block.host, non_blocking=self._pin)
        copied = mod.Event()
        copied.record(side)
        block.storage, block.copied, block.ready, block.state = buffer.untyped_storage(), copied, copied, _BACK

    # ---- host buffers --------------------------------------------------------------------------

    def _retire(self, event, host: torch.Tensor) -> None:
        """Free `host` once `event` (its last copy) completed, at the next sweep (layer starts, unpacks)."""
        with self._lock:
            self._retiring.append((event, host))

    def _sweep(self) -> None:
        with self._lock:
            pending, self._retiring = self._retiring, []
        keep, freed = [], 0
        for event, host in pending:
            if event.query():
                freed += host.numel()
            else:
                keep.append((event, host))
        del pending
        with self._lock:
            self._retiring.extend(keep)
            self.host_bytes -= freed


def _unpack(saved):
    return saved if isinstance(saved, torch.Tensor) else saved.block.owner._restore(saved)


def _recomputing(module: nn.Module) -> bool:
    """True while a composable activation checkpoint recomputes `module` in backward (it turns its own
    hooks off for the recompute)."""
    state = composable_checkpoint.state(module)
    return state is not None and not state.enable_hook


def _name_matches(pattern: str, name: str) -> bool:
    """VeOmni's module patterns: one glob per dot-separated segment ("{*}" = "*"), same segment count."""
    pattern_parts, name_parts = pattern.replace("{*}", "*").split("."), name.split(".")
    return len(pattern_parts) == len(name_parts) and all(
        fnmatch.fnmatchcase(n, p) for p, n in zip(pattern_parts, name_parts)
    )


def select_layers(names: Sequence[str], patterns: Sequence[str]) -> list[int]:
    """Indices of the decoder layers (`names`, in forward order, e.g. "model.layers.3") that any of
    `patterns` (VeOmni's `activation_offload_modules`) matches; every layer when `patterns` is empty.
    Raises ValueError naming the option for a pattern that matches no decoder layer."""
    if not patterns:
        return list(range(len(names)))
    for pattern in patterns:
        if not any(_name_matches(pattern, n) for n in names):
            raise ValueError(
                f"activation_offload_modules: {pattern!r} matches no decoder layer (verl_moe offloads decoder "
                "layers only, e.g. 'model.layers.{*}')"
            )
    return [i for i, n in enumerate(names) if any(_name_matches(p, n) for p in patterns)]
