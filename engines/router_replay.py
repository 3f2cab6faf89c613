"""Router replay (verl's `engine.router_replay.mode`: "R2", "R3") for our engines.

MoE policy-gradient steps are unstable when the experts a token is routed to in the training forward
differ from those of the forward that produced the old log-probs (or of the rollout). Replay fixes the
expert ids and recomputes only the combine weights from the current router (`models/layers.py::
replayed_topk_weight`: fp32 softmax over all experts gathered at the ids, renormalised as the model
does), so the router keeps its gradient.

- R2: the forward-only pass that computes the old log-probs (verl's `compute_log_prob` -> `infer_batch`)
  records each MoE layer's top-k ids per token and returns them as `model_output["routed_experts"]`;
  verl's trainer puts them in the batch, and the training forwards of that batch (`train_batch`)
  replay them.
- R3: every forward replays the batch's `routed_experts` as the rollout returned them
  (`rollout.enable_rollout_routing_replay`).

Data contract (verl's VeOmni engine's): `routed_experts` is nested [N, j, L, TOPK] (int16 from
verl's agent loop and from our recording), one row per token of `input_ids` in the same order,
L = the model's decoder layers (the rollout's absolute layer index; a dense layer's slot is ignored
and recorded as 0). A row whose TOPK ids repeat one (the zeros verl leaves where the rollout recorded
nothing, e.g. the last generated token) is routed freely, as in verl; a sequence one row short (the
final token, as Megatron's R3 path allows) gets such a row. verl's worker sets the batch switch
`enable_routing_replay` (False for the reference model); an engine with replay on treats a batch
without it as on (verl's worker sets it only for the megatron and veomni strategies).

Per micro-batch the engine arms one `RouterReplay` (a slot per MoE layer, set as that layer's
`TopKRouter.override`), runs forward and backward (recomputation under activation checkpointing sees
the same armed ids), then disarms it. A tiled MoE block (`MoeBlock.checkpoint_tile_tokens`) calls its
slot once per tile with the tile's rows of the layer's tokens. Under Ulysses SP each rank arms its
slice of the packed row (`batch.sequence_shard`, as `batch.slice_packed` cuts the tokens) and recordings
are gathered back.

Alphabet: N sequences, T packed tokens, L decoder layers, E experts, TOPK experts per token.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl_moe.engines.batch import PackedBatch, sequence_shard, unpack_to_nested
from verl_moe.models.fsdp_plan import decoder_layers
from verl_moe.models.layers import MoeBlock
from verl_moe.models.process_groups import UlyssesGroup

MODES = ("disabled", "R2", "R3")
RECORD, REPLAY = "record", "replay"


def step_action(mode: str, data: TensorDict, forward_only: bool) -> str | None:
    """What one `forward_backward_batch` call does with routing: RECORD (R2, forward only), REPLAY
    (R2 training, R3 always) or None (replay off, or the batch's `enable_routing_replay` is False).

    Raises ValueError for an unknown mode, or a batch asking for routing replay from an engine whose
    router_replay.mode is "disabled"."""
    if mode not in MODES:
        raise ValueError(f"router_replay.mode must be one of {MODES}, got {mode!r}")
    flag = tu.get_non_tensor_data(data, "enable_routing_replay", None)
    if mode == "disabled":
        if flag:
            raise ValueError("the batch sets enable_routing_replay=True; this engine has router_replay.mode='disabled'")
        return None
    if flag is not None and not flag:
        return None
    return RECORD if mode == "R2" and forward_only else REPLAY


class _LayerSlot:
    """One MoE layer's `RoutingOverride`: replays `targets` where `valid`, or records the free ids.

    A call covers the layer's tokens `rows` (a contiguous slice: one tile of a tiled `MoeBlock`;
    None: all of them). Replay reads those rows of `targets`; recording keeps the first call for each
    row range (later calls are the backward recomputation of the same forward), and `recorded`
    assembles the tiles in token order."""

    def __init__(self) -> None:
        self.recording = False
        self.targets: torch.Tensor | None = None  # [T, TOPK] int64
        self.valid: torch.Tensor | None = None  # [T, 1] bool
        self._tiles: dict[int, torch.Tensor] = {}  # first row -> that call's free ids [n, TOPK]

    def __call__(self, free_idx: torch.Tensor, rows: slice | None = None) -> torch.Tensor | None:
        if self.targets is not None:
            targets, valid = (self.targets, self.valid) if rows is None else (self.targets[rows], self.valid[rows])
            if targets.shape != free_idx.shape:
                where = "" if rows is None else f" (rows {rows.start}:{rows.stop} of {self.targets.shape[0]})"
                raise ValueError(
                    f"router replay targets {tuple(targets.shape)}{where} for a router call on "
                    f"{tuple(free_idx.shape)} ids: the batch's routed_experts do not match the tokens"
                )
            return torch.where(valid, targets, free_idx)
        start = 0 if rows is None else rows.start or 0
        if self.recording and start not in self._tiles:
            self._tiles[start] = free_idx.detach().clone()
        return None

    @property
    def recorded(self) -> torch.Tensor | None:
        """The recorded free ids [T, TOPK] int64 in token order, or None before any call."""
        if not self._tiles:
            return None
        starts = sorted(self._tiles)
        pieces = [self._tiles[s] for s in starts]
        ends = [s + p.shape[0] for s, p in zip(starts, pieces)]
        if starts != [0, *ends[:-1]]:
            raise RuntimeError(f"router replay: the recorded tiles (first rows {starts}) do not cover the tokens")
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def clear(self) -> None:
        self.recording, self.targets, self.valid, self._tiles = False, None, None, {}


class RouterReplay:
    """The routing override of one model: a slot per MoE layer, installed on its router.

    Args:
        model: the spec (`MoeCausalLM` / `MoeVisionLM`, sharded or not); its decoder layers in order
            give the L axis of `routed_experts` (the rollout's layers: not the MTP module's).
    Raises ValueError for a model without MoE layers.
    """

    def __init__(self, model: torch.nn.Module):
        layers = list(decoder_layers(model))  # the MTP module's layers route freely: no slot
        routers = [layer.mlp.gate if isinstance(layer.mlp, MoeBlock) else None for layer in layers]
        if not any(r is not None for r in routers):
            raise ValueError(f"router_replay needs MoE layers; {type(model).__name__} has none")
        first = next(r for r in routers if r is not None)
        self.num_layers, self.top_k, self.num_experts = len(layers), first.top_k, first.weight.shape[0]
        self.slots: list[_LayerSlot | None] = []
        for router in routers:
            slot = None if router is None else _LayerSlot()
            if router is not None:
                router.override = slot
            self.slots.append(slot)

    def _moe_slots(self) -> Iterator[tuple[int, _LayerSlot]]:
        return ((i, slot) for i, slot in enumerate(self.slots) if slot is not None)

    @contextmanager
    def armed(self, action: str, micro_batch: TensorDict, packed: PackedBatch, sp: UlyssesGroup | None):
        """Arm every slot for one micro-batch (its forward and backward), disarm on exit. REPLAY reads
        `micro_batch["routed_experts"]` (`replay_targets`); RECORD keeps the free ids (`recorded`)."""
        if action == REPLAY:
            targets, valid = self.replay_targets(micro_batch, packed, sp)
            for i, slot in self._moe_slots():
                slot.targets, slot.valid = targets[:, i], valid[:, i, None]
        elif action == RECORD:
            for _, slot in self._moe_slots():
                slot.recording = True
        else:
            raise ValueError(f"router replay action must be {RECORD!r} or {REPLAY!r}, got {action!r}")
        try:
            yield
        finally:
            for _, slot in self._moe_slots():
                slot.clear()

    def replay_targets(
        self, micro_batch: TensorDict, packed: PackedBatch, sp: UlyssesGroup | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (targets [T', L, TOPK] int64, valid [T', L] bool) from the micro-batch's
        nested `routed_experts` [N, j, L, TOPK]; T' = T, or this rank's slice of the padded row under
        SP (pad rows invalid). Rows with a repeated id are invalid (routed freely).

        Raises ValueError naming the shapes when routed_experts is missing, not nested, has other
        [L, TOPK] than the model or other sequence lengths than input_ids (one row short per
        sequence is allowed), or holds ids outside [0, E)."""
        if "routed_experts" not in micro_batch.keys():
            raise ValueError(
                "router replay needs the batch's routed_experts [N, j, L, TOPK]: R2 records them in "
                "infer_batch (compute_log_prob), R3 takes them from the rollout "
                "(rollout.enable_rollout_routing_replay=True); this batch has none"
            )
        routed = micro_batch["routed_experts"]
        if not getattr(routed, "is_nested", False):
            raise ValueError(
                f"routed_experts must be verl's nested [N, j, L, TOPK] (left_right_2_no_padding), "
                f"got a dense tensor of shape {tuple(routed.shape)}"
            )
        values = routed.values()
        expected = (self.num_layers, self.top_k)
        if values.dim() != 3 or tuple(values.shape[1:]) != expected:
            raise ValueError(
                f"routed_experts rows are {tuple(values.shape[1:])}, the model needs [L, TOPK] = {expected} "
                f"({self.num_layers} decoder layers, top_k={self.top_k})"
            )
        route_lens = routed.offsets().diff().tolist()
        token_lens = packed.offsets.diff().tolist()
        if len(route_lens) != len(token_lens) or any(r not in (t, t - 1) for r, t in zip(route_lens, token_lens)):
            raise ValueError(
                f"routed_experts hold {route_lens} rows per sequence for input_ids of {token_lens} tokens "
                "(equal, or one row short for the last token)"
            )
        low, high = int(values.min()), int(values.max())
        if values.numel() and (low < 0 or high >= self.num_experts):
            raise ValueError(f"routed_experts hold expert ids in [{low}, {high}], outside [0, E={self.num_experts})")
        values = values.to(device=packed.input_ids.device, dtype=torch.int64)
        if route_lens != token_lens:  # a zero row (invalid: repeated ids) for each missing last token
            pieces, start = [], 0
            for r, t in zip(route_lens, token_lens):
                pieces += [values[start : start + r], values.new_zeros(t - r, *expected)]
                start += r
            values = torch.cat(pieces)
        ordered = values.sort(dim=-1).values
        valid = (ordered[..., 1:] != ordered[..., :-1]).all(dim=-1)
        if sp is None:
            return values, valid
        pad, local = sequence_shard(values.shape[0], sp)
        values = torch.cat([values, values.new_zeros(pad, *expected)])
        valid = torch.cat([valid, valid.new_zeros(pad, self.num_layers)])
        return values[local], valid[local]

    def recorded(self, packed: PackedBatch, sp: UlyssesGroup | None) -> torch.Tensor:
        """The armed forward's free ids as verl's nested routed_experts [N, j, L, TOPK] int16 (a
        dense layer's slot 0), gathered over the Ulysses group. Call inside `armed(RECORD, ...)`."""
        pieces = []
        for i, slot in enumerate(self.slots):
            if slot is not None and slot.recorded is None:
                raise RuntimeError(f"router replay: MoE layer {i} did not run in the recorded forward")
            pieces.append(None if slot is None else slot.recorded)
        shape = next(p for p in pieces if p is not None).shape
        device = packed.input_ids.device
        # int32 for the gather: gloo has no int16 collectives
        zeros = torch.zeros(shape, dtype=torch.int32, device=device)
        ids = torch.stack([zeros if p is None else p.int() for p in pieces], dim=1)
        if sp is not None:
            ids = sp.gather_tokens(ids, sequence_shard(packed.num_tokens, sp)[0])
        return unpack_to_nested(ids.to(torch.int16), packed)
