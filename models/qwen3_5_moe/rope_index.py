"""3-row mRoPE position ids (temporal, height, width) of a Qwen3.5 vision-language sequence,
computed from the image / video grids as transformers' `Qwen3_5MoeModel.get_rope_index` does.

Per sequence, tokens split into runs of one modality (text; image placeholders; video
placeholders, each video frame being its own run between timestamp text). A text run of n tokens
takes positions p .. p+n-1 on all three rows; a vision run with grid (t, h, w) and merge size SM
takes t * (h/SM) * (w/SM) tokens with temporal row p + frame, height row p + patch row and width
row p + patch col (row-major), after which p advances by max(h, w) / SM. Images and video frames
consume their grids in order over the whole batch (rows, or the packed sequences of one row).
"""

from __future__ import annotations

import torch

from ...ops.varlen import check_cu_seqlens


def _vision_positions(start: int, t: int, h: int, w: int) -> torch.Tensor:
    """[3, t * h * w] positions of one vision run of t frames of h x w merged tokens."""
    temporal = torch.arange(t).repeat_interleave(h * w)
    height = torch.arange(h).repeat_interleave(w).repeat(t)
    width = torch.arange(w).repeat(h * t)
    return torch.stack([temporal, height, width]) + start


def _sequence_positions(ids: torch.Tensor, image_token_id: int, video_token_id: int, grids: dict, merge: int):
    """Positions [3, n] of one unpadded sequence `ids` [n] (CPU), consuming from `grids` (modality ->
    iterator of [t, h, w] host lists). Raises ValueError on a run that does not match its grid."""
    kind = torch.zeros_like(ids)
    kind[ids == image_token_id] = 1
    kind[ids == video_token_id] = 2
    n = ids.numel()
    if n == 0:
        return torch.zeros(3, 0, dtype=torch.int64)
    bounds = [0, *((kind[1:] != kind[:-1]).nonzero().flatten() + 1).tolist(), n]
    parts, p = [], 0
    for s, e in zip(bounds[:-1], bounds[1:]):
        modality = int(kind[s])
        if modality == 0:
            parts.append(torch.arange(p, p + e - s).expand(3, -1))
            p += e - s
            continue
        what = "image" if modality == 1 else "video"
        grid = next(grids[modality], None)
        if grid is None:
            raise ValueError(f"more {what} placeholder runs than {what}_grid_thw rows (a run of {e - s} has no grid)")
        t, h, w = grid[0], grid[1] // merge, grid[2] // merge
        if t * h * w != e - s:
            raise ValueError(
                f"a run of {e - s} {what} placeholder tokens does not match its {what} grid {grid}: "
                f"{t * h * w} tokens ({t} x {h} x {w} after merging {merge} x {merge})"
            )
        parts.append(_vision_positions(p, t, h, w))
        p += max(h, w)
    return torch.cat(parts, dim=1)


def mrope_position_ids(
    input_ids: torch.Tensor,
    image_token_id: int,
    video_token_id: int,
    spatial_merge_size: int,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """mRoPE position ids of a batch, as transformers' `get_rope_index` (token types taken from the
    placeholder ids, as the processor's `mm_token_type_ids` are).

    Args:
        input_ids: [B, T] int. image_token_id / video_token_id: placeholder ids.
        spatial_merge_size: SM of the vision tower.
        image_grid_thw: [N_img, 3] int (t, h, w in patches) per image in order, or None.
        video_grid_thw: [N_vid, 3] int per video, or None; each of a video's t frames is one run.
        cu_seqlens: [S+1] offsets of packed sequences (B == 1): positions restart per sequence.
        attention_mask: [B, T] 0/1 (not with cu_seqlens): masked tokens are skipped and get 0.
    Returns:
        position_ids: [3, B, T] in input_ids' dtype and device.
        rope_deltas: [S, 1] int64 (S = B rows, or the packed sequences): max position + 1 - length.
    Raises:
        ValueError: bad shapes, both cu_seqlens and attention_mask, a placeholder run that does not
            match its grid (both counts named), more runs than grids or grids left over.
    """
    if input_ids.dim() != 2 or input_ids.is_floating_point():
        raise ValueError(f"input_ids must be [B, T] int, got {tuple(input_ids.shape)} {input_ids.dtype}")
    B, T = input_ids.shape
    if cu_seqlens is not None and attention_mask is not None:
        raise ValueError("give cu_seqlens (packed row) or attention_mask (padded rows), not both")
    if attention_mask is not None and tuple(attention_mask.shape) != (B, T):
        raise ValueError(f"attention_mask must be [B={B}, T={T}], got {tuple(attention_mask.shape)}")
    ids = input_ids.detach().cpu()
    grids = {}
    for modality, what, grid in ((1, "image", image_grid_thw), (2, "video", video_grid_thw)):
        if grid is not None and (grid.dim() != 2 or grid.shape[1] != 3):
            raise ValueError(f"{what}_grid_thw must be [N, 3], got {tuple(grid.shape)}")
        rows = [] if grid is None else grid.tolist()
        if modality == 2:  # one grid per frame: frames are separated by timestamp tokens
            rows = [[1, h, w] for t, h, w in rows for _ in range(t)]
        grids[modality] = iter(rows)
    position_ids = torch.zeros(3, B, T, dtype=torch.int64)
    deltas = []
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"packed input (cu_seqlens) needs B == 1, got B={B}")
        offsets = check_cu_seqlens(cu_seqlens, T)
        spans = [(0, slice(s, e)) for s, e in zip(offsets[:-1], offsets[1:])]
    else:
        mask = None if attention_mask is None else attention_mask.detach().cpu().bool()
        spans = [(b, slice(None) if mask is None else mask[b]) for b in range(B)]
    for b, where in spans:
        seq = ids[b, where]
        pos = _sequence_positions(seq, image_token_id, video_token_id, grids, spatial_merge_size)
        position_ids[:, b, where] = pos
        deltas.append((int(pos.max()) + 1 if pos.numel() else 0) - seq.numel())
    for modality, what in ((1, "image"), (2, "video")):
        left = sum(1 for _ in grids[modality])
        if left:
            raise ValueError(f"{left} {what} grid(s) (frames for video) have no placeholder run in input_ids")
    return (
        position_ids.to(device=input_ids.device, dtype=input_ids.dtype),
        torch.tensor(deltas, dtype=torch.int64, device=input_ids.device)[:, None],
    )
