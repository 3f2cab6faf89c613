"""Batches in and out of our engines: pure functions over verl's TensorDict micro-batches.

verl hands an engine a TensorDict whose sequences are jagged nested tensors (`input_ids`,
`position_ids`, `loss_mask`, ...; layout `[N, j]`) plus non-tensor switches (`temperature`,
`use_dynamic_bsz`, `max_token_len_per_gpu`, `micro_batch_size_per_gpu`, `calculate_entropy`).
Here: refuse switches we do not implement (`check_batch_options`), split a batch into micro-batches
that every data-parallel rank agrees on (`split_micro_batches`), pack one micro-batch into one row
(`[1, T]` with `cu_seqlens`, and the same offsets as host ints, `cu_seqlens_cpu`, so no op reads them
back from the device: `pack_micro_batch`), slice that row over a Ulysses group (`slice_packed`), and
turn per-token results back into nested tensors (`unpack_to_nested`; verl's `postprocess_batch_func`
then puts the micro-batches back in the batch's order). The only collectives are the agreements over
the data-parallel group (`global_token_count`, `split_micro_batches`).

Images (vision-language checkpoints): verl's per-sample `multi_modal_inputs` dicts (`pixel_values`
[P_i, C*TP*PS*PS] and `image_grid_thw` [n_i, 3] per sample, videos likewise) are concatenated in the
micro-batch's sequence order (`multimodal_inputs`), as the placeholders appear in the packed row; the
position ids are then verl's 4 rows (text, then the 3 mRoPE rows) per token.

Alphabet: N sequences in a micro-batch, T packed tokens, P pixel patches.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.dataset.dataset_utils import DatasetPadMode
from verl_moe.models.process_groups import UlyssesGroup
from verl_moe.ops import device
from verl_moe.ops.device import to_device
from verl_moe.ops.varlen import offsets_tensor

# Batch switches our engines do not implement: asking for one is an error, never a silent no-op.
UNSUPPORTED_SWITCHES = (
    "calculate_sum_pi_squared",
    "distillation_use_topk",
    "distillation_only",
)

# verl's multi_modal_inputs keys the model takes; keys derived from them that the model does not need
# (verl's agent loop adds images_seqlens; the token types are read from the placeholder ids)
MEDIA_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
DERIVED_MEDIA_KEYS = ("images_seqlens", "videos_seqlens", "mm_token_type_ids")


@dataclass(frozen=True)
class PackedBatch:
    """One micro-batch as a single packed row.

    input_ids: [1, T] int64, memory-contiguous.
    position_ids: [1, T] int64 (each sequence counts from its first real token), or [4, 1, T] for a
        vision-language batch (verl's text row, then the 3 mRoPE rows); memory-contiguous.
    cu_seqlens: [N+1] int32, sequence boundaries in the packed row.
    labels: [T] int64, the packed row shifted left by one (labels[t] = input_ids[t+1]); the
        label of each sequence's last token is never read by verl's losses.
    inv_temperature: [T] fp32, 1 / each sequence's sampling temperature, repeated over its tokens:
        validated (finite, > 0) and inverted once here, what the log-prob head takes as it is.
    offsets: [N+1] int64, the nested tensors' offsets (what unpacking returns to).
    cu_seqlens_cpu: cu_seqlens as host ints (None: the ops read cu_seqlens themselves). A tuple, not
        a tensor: FSDP's root unit moves every tensor of its inputs to the device.
    media: the micro-batch's `MEDIA_KEYS` present (pixels of its samples concatenated in order, grids
        stacked); empty for text.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    labels: torch.Tensor
    inv_temperature: torch.Tensor
    offsets: torch.Tensor
    cu_seqlens_cpu: tuple[int, ...] | None = None
    media: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]


def check_batch_options(data: TensorDict) -> None:
    """Raise ValueError for verl batch switches our engines do not implement."""
    pad_mode = tu.get_non_tensor_data(data=data, key="pad_mode", default=DatasetPadMode.NO_PADDING)
    if pad_mode != DatasetPadMode.NO_PADDING:
        raise ValueError(f"verl_moe engines take NO_PADDING (nested) batches, got pad_mode={pad_mode}")
    for key in UNSUPPORTED_SWITCHES:
        if tu.get_non_tensor_data(data=data, key=key, default=False):
            raise ValueError(f"verl_moe engines do not implement {key}=True")
    if not data["input_ids"].is_nested:
        raise ValueError("verl_moe engines expect jagged nested input_ids (verl's left_right_2_no_padding)")
    positions = data["position_ids"]
    if positions.dim() not in (2, 3):
        raise ValueError(f"verl_moe engines take position_ids [N, j] or [N, 4, j], got {positions.dim()}-D")


def multimodal_inputs(micro_batch: TensorDict, device: torch.device) -> dict[str, torch.Tensor]:
    """The micro-batch's `multi_modal_inputs` (one dict, or None / {} for a text sample, per sequence)
    as one dict on `device`: each `MEDIA_KEYS` entry concatenated over the samples in order (what the
    packed row's placeholders read in order); {} when no sample has media.

    Raises ValueError on a key the engines do not feed to the model (naming it) or a grid without
    its pixels (and the reverse)."""
    if "multi_modal_inputs" not in micro_batch.keys():
        return {}
    pieces: dict[str, list[torch.Tensor]] = {}
    for item in micro_batch.get("multi_modal_inputs"):
        item = getattr(item, "data", item)
        for key, value in (item or {}).items():
            if value is None or key in DERIVED_MEDIA_KEYS:
                continue
            if key not in MEDIA_KEYS:
                raise ValueError(f"multi_modal_inputs key {key!r} is not supported by verl_moe's engines: {MEDIA_KEYS}")
            pieces.setdefault(key, []).append(torch.as_tensor(value))
    media = {key: torch.cat(values).to(device) for key, values in pieces.items()}
    for pixels, grid in (MEDIA_KEYS[:2], MEDIA_KEYS[2:]):
        if (pixels in media) != (grid in media):
            have, lack = (pixels, grid) if pixels in media else (grid, pixels)
            raise ValueError(f"multi_modal_inputs hold {have} without {lack}")
    return media


def pack_micro_batch(micro_batch: TensorDict, device: torch.device) -> PackedBatch:
    """Nested `input_ids` / `position_ids` / `temperature` of one micro-batch -> `PackedBatch` on `device`.

    The micro-batch should still be on the host (as verl hands it over): its sequence boundaries and
    temperatures are read there, without waiting for the device, and travel on with the packed row.
    Raises ValueError on position ids or temperatures that do not match the sequences, or a
    temperature that is not finite and > 0."""
    input_ids = micro_batch["input_ids"]
    offsets = input_ids.offsets().to(torch.int64)
    bounds = tuple(offsets.tolist())
    seq_lens = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    ids = input_ids.values().to(device=device, dtype=torch.int64).contiguous()
    # .values() of a nested tensor can be a strided view; kernels index positions by pointer.
    positions = micro_batch["position_ids"]
    if positions.dim() == 3:
        positions = _four_rows(positions.values(), seq_lens)
    else:
        positions = positions.values()
    positions = positions.to(device=device, dtype=torch.int64).contiguous()
    if positions.shape[-1] != ids.shape[0]:
        raise ValueError(f"position_ids hold {positions.shape[-1]} tokens, input_ids {ids.numel()}")
    # [T] or, for verl's multimodal rows, [4, T] -> [1, T] / [4, 1, T]
    positions = positions.unsqueeze(-2)
    return PackedBatch(
        input_ids=ids.unsqueeze(0),
        position_ids=positions,
        cu_seqlens=offsets_tensor(bounds, device),
        labels=torch.roll(ids, shifts=-1, dims=0),
        inv_temperature=inverse_temperature(micro_batch["temperature"], seq_lens, device),
        offsets=offsets,
        cu_seqlens_cpu=bounds,
        media=multimodal_inputs(micro_batch, device),
    )


def inverse_temperature(temperature: torch.Tensor | float, seq_lens: list[int], device: torch.device) -> torch.Tensor:
    """[T] fp32 1 / temperature per token, from verl's per-sequence [N] tensor or one number.
    Raises ValueError on a count that does not match the sequences or a value not finite and > 0."""
    if isinstance(temperature, torch.Tensor):
        per_seq = temperature.detach().to(torch.float32).reshape(-1)
        if per_seq.numel() != len(seq_lens):
            raise ValueError(f"temperature has {per_seq.numel()} entries for {len(seq_lens)} sequences")
    else:
        per_seq = torch.tensor([float(temperature)], dtype=torch.float32)
    if not bool(((per_seq > 0) & torch.isfinite(per_seq)).all()):
        raise ValueError(f"temperature must be finite and > 0 for every sequence, got {per_seq.tolist()}")
    inverse = (1.0 / per_seq).cpu()  # fp32 division, as the head computed it from the fp32 temperature
    if inverse.numel() == 1:
        return torch.full((sum(seq_lens),), inverse.item(), dtype=torch.float32, device=device)
    return to_device(torch.repeat_interleave(inverse, torch.tensor(seq_lens)), device)


def _four_rows(values: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
    """[4, T] from the values of verl's nested [N, 4, j] position ids. torch stores them as [4, T] (the
    token dim ragged), except when every sequence has the same length L: then it makes the 4 rows the
    ragged dim and stores [N * 4, L] (verl's maybe_fix_3d_position_ids only relabels the ragged dim, so
    unbind fails on those). Raises ValueError on any other layout."""
    n, total = len(seq_lens), sum(seq_lens)
    if values.dim() == 2 and values.shape == (4, total):
        return values
    if values.dim() == 2 and values.shape == (4 * n, seq_lens[0]) and len(set(seq_lens)) == 1:
        return values.reshape(n, 4, seq_lens[0]).transpose(0, 1).reshape(4, total)
    raise ValueError(
        f"3-D position_ids must be verl's 4 rows per sequence (text + 3 mRoPE) over {total} tokens, "
        f"got values {tuple(values.shape)}"
    )


def unpack_to_nested(values: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
    """[T] per-token values -> jagged nested [N, j] with the micro-batch's offsets."""
    if values.shape[0] != packed.num_tokens:
        raise ValueError(f"expected {packed.num_tokens} per-token values, got {values.shape[0]}")
    return torch.nested.nested_tensor_from_jagged(values, packed.offsets.to(values.device))


def global_token_count(data: TensorDict, dp_group) -> int:
    """Sum of `loss_mask` over the whole data-parallel batch (verl's `batch_num_tokens`)."""
    loss_mask = data["loss_mask"]
    # on the accelerator: NCCL / HCCL reduce only device tensors
    local = (loss_mask.values() if loss_mask.is_nested else loss_mask).sum().to(device.current_device(), torch.int64)
    local = local.reshape(1)
    if dist.is_initialized():
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=dp_group)
    return int(local.item())


def _balanced_bins(seq_lens: list[int], num_bins: int) -> list[list[int]]:
    """Longest-processing-time greedy: each sequence (longest first) to the lightest bin."""
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    loads = [0] * num_bins
    for i in sorted(range(len(seq_lens)), key=lambda i: (-seq_lens[i], i)):
        target = min(range(num_bins), key=lambda b: (loads[b], b))
        bins[target].append(i)
        loads[target] += seq_lens[i]
    return [sorted(b) for b in bins]


def _agreed_max(values: list[int], problem: str | None, dp_group) -> list[int]:
    """Max of each of `values` over the data-parallel group (pass -x for a min). When any rank has a
    `problem`, every rank raises it as a ValueError (so none is left waiting in a collective)."""
    local = torch.tensor([int(problem is not None), *values], dtype=torch.int64, device=device.current_device())
    if dist.is_initialized():
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=dp_group)
    failed, *agreed = local.tolist()
    if failed:
        problems = [problem]
        if dist.is_initialized():
            problems = [None] * dist.get_world_size(dp_group)
            dist.all_gather_object(problems, problem, group=dp_group)
        rank, message = next((rank, p) for rank, p in enumerate(problems) if p is not None)
        raise ValueError(message if problem is not None else f"data-parallel rank {rank}: {message}")
    return agreed


def split_micro_batches(
    seq_lens: list[int],
    *,
    use_dynamic_bsz: bool,
    micro_batch_size: int | None,
    max_token_len: int | None,
    dp_group=None,
) -> list[list[int]]:
    """Indices of each micro-batch; every data-parallel rank gets the same count (FSDP runs its
    collectives once per forward, so a rank with one forward more would wait forever).

    Not verl's `prepare_micro_batches`: it asserts on one rank (a batch that does not divide by the
    micro-batch size, a sequence over the token budget) while the others wait in its all_reduce, and
    it hands back TensorDicts where we pack each micro-batch from its indices on the host.

    By count: consecutive chunks of `micro_batch_size` sequences (the last may be shorter); the
    ranks must hold as many chunks (verl's dispatch gives them equal batches), else all raise.
    Dynamic: k = ceil(tokens / max_token_len), raised to the largest k over the data-parallel
    group, then balanced by tokens.

    Raises ValueError, on every rank of `dp_group` together, on an empty batch, a micro-batch
    size larger than the batch, a sequence longer than `max_token_len`, ranks whose counts differ
    (by count) or a rank with fewer sequences than the agreed count (dynamic).
    """
    n = len(seq_lens)
    problem = None
    if n == 0:
        problem = "empty batch"
    elif use_dynamic_bsz:
        if max_token_len is None or max_token_len <= 0:
            problem = f"use_dynamic_bsz needs max_token_len_per_gpu > 0, got {max_token_len}"
        elif max(seq_lens) > max_token_len:
            problem = f"a sequence of {max(seq_lens)} tokens exceeds max_token_len_per_gpu={max_token_len}"
        count = 0 if problem else -(-sum(seq_lens) // max_token_len)
        num_bins, neg_fewest = _agreed_max([count, -n], problem, dp_group)
        if num_bins > -neg_fewest:
            raise ValueError(
                f"{num_bins} micro-batches needed to match the ranks' largest token count, but a "
                f"data-parallel rank holds only {-neg_fewest} sequences (this rank: {n})"
            )
        return _balanced_bins(seq_lens, num_bins)
    elif micro_batch_size is None or micro_batch_size <= 0:
        problem = f"micro_batch_size_per_gpu must be positive, got {micro_batch_size}"
    elif micro_batch_size > n:
        problem = f"micro_batch_size_per_gpu={micro_batch_size} is larger than the batch on this rank ({n})"
    count = 0 if problem else -(-n // micro_batch_size)
    most, neg_least = _agreed_max([count, -count], problem, dp_group)
    if most != -neg_least:
        raise ValueError(
            f"data-parallel ranks hold {-neg_least} to {most} micro-batches of micro_batch_size_per_gpu="
            f"{micro_batch_size} (this rank: {n} sequences, {count}); every rank must run as many "
            "forwards: give the ranks equal batches, or use_dynamic_bsz"
        )
    return [list(range(start, min(start + micro_batch_size, n))) for start in range(0, n, micro_batch_size)]


def select_micro_batch(data: TensorDict, indices: list[int]) -> TensorDict:
    """Rows `indices` of `data` (nested tensors re-packed, non-tensor switches kept)."""
    return tu.index_select_tensor_dict(data, indices)


def slice_packed(packed: PackedBatch, sp: UlyssesGroup) -> tuple[PackedBatch, int]:
    """This rank's T/sp tokens of a packed row, padded to a multiple of sp, and the pad size.

    input_ids, position_ids (along the token dim), labels, inv_temperature are sliced; cu_seqlens stays
    global (the sequence ops run on whole sequences after `seq_to_heads`) with the pad as one more
    sequence. Images and videos stay whole on every rank: the model runs the tower on all of them and
    keeps the features of this rank's placeholders (`MoeVisionLM`).
    """
    total = packed.num_tokens
    pad, local = sequence_shard(total, sp)
    ids, pos = packed.input_ids, packed.position_ids
    labels, inv_temperature, cu, cu_cpu = (
        packed.labels,
        packed.inv_temperature,
        packed.cu_seqlens,
        packed.cu_seqlens_cpu,
    )
    if pad:
        ids = torch.nn.functional.pad(ids, (0, pad))
        tail = torch.arange(pad, dtype=pos.dtype, device=pos.device).expand(*pos.shape[:-1], pad)
        pos = torch.cat([pos, tail], dim=-1)
        labels = torch.nn.functional.pad(labels, (0, pad))
        inv_temperature = torch.nn.functional.pad(inv_temperature, (0, pad), value=1.0)
        cu = torch.cat([cu, cu.new_tensor([total + pad])])
        cu_cpu = None if cu_cpu is None else (*cu_cpu, total + pad)
    return (
        replace(
            packed,
            input_ids=ids[:, local],
            position_ids=pos[..., local],
            labels=labels[local],
            inv_temperature=inv_temperature[local],
            cu_seqlens=cu,
            cu_seqlens_cpu=cu_cpu,
        ),
        pad,
    )


def sequence_shard(total: int, sp: UlyssesGroup) -> tuple[int, slice]:
    """(pad, this rank's token slice) of a packed row of `total` tokens over a Ulysses group: the row
    is padded to a multiple of sp.size and each rank takes one contiguous equal share (what
    `slice_packed` does to every per-token tensor)."""
    pad = -total % sp.size
    share = (total + pad) // sp.size
    return pad, slice(sp.rank * share, (sp.rank + 1) * share)
