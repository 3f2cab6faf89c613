"""Qwen3.5-MoE's vision tower (transformers' `Qwen3_5MoeVisionModel`, `model.visual.*`).

pixel_values arrive as flattened patches [P, C * TP * PS * PS] (the processor's layout: each
merge window's SM * SM patches consecutive, frames of a video one after another), with
`grid_thw` [N, 3] giving each image's (frames / TP, rows, cols) of patches. Per patch:

- patch_embed: a [C, TP, PS, PS] -> D projection (a Conv3d whose kernel equals its stride, run as
  one GEMM over the flattened patch);
- plus a learned position embedding, bilinearly interpolated from a G x G table to the image's
  rows x cols (G = sqrt(num_position_embeddings));
- `depth` pre-LayerNorm ViT blocks: bidirectional attention inside each frame (varlen over the
  frames, `ops.attention` with causal=False) with 2-D rotary (the first half of each head's
  rotary frequencies follows the patch row, the second half the column), then a GELU MLP;
- merger: LayerNorm, then each SM x SM window's features concatenated and projected by a GELU
  MLP to out_hidden_size (the text model's D): one feature per image placeholder token.

Rotary and attention run through the model's resolved ops; LayerNorm and GELU are torch's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...ops.rope import rope_inv_freq
from ...ops.varlen import offsets_tensor
from ..layers import ResolvedOps

# transformers' ACT2FN names for the ViT MLP -> F.gelu's `approximate`
VISION_ACTS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}
VISION_ROPE_THETA = 10000.0
LAYER_NORM_EPS = 1e-6


@dataclass(frozen=True)
class VisionArch:
    """Shapes of the vision tower and the placeholder tokens its features replace.

    Attributes:
        depth: ViT blocks. hidden_size: DV. intermediate_size: ViT MLP width. num_heads: HV heads of DV / HV.
        in_channels, patch_size, temporal_patch_size: C, PS, TP of one patch [C, TP, PS, PS].
        spatial_merge_size: SM; SM x SM patches become one placeholder token.
        out_hidden_size: merger output width, equal to the text model's hidden size.
        num_position_embeddings: rows of the learned position table, G * G.
        hidden_act: the ViT MLP's activation ("gelu_pytorch_tanh" or "gelu").
        initializer_range: std of the normal init of fresh vision weights.
        image_token_id, video_token_id: placeholder token ids in input_ids.
    """

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    hidden_act: str
    initializer_range: float
    image_token_id: int
    video_token_id: int

    def __post_init__(self):
        for name in (
            "depth",
            "hidden_size",
            "intermediate_size",
            "num_heads",
            "in_channels",
            "patch_size",
            "temporal_patch_size",
            "spatial_merge_size",
            "out_hidden_size",
            "num_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"vision_config.{name} must be a positive int, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"vision_config.hidden_size={self.hidden_size} must be a multiple of num_heads={self.num_heads}"
            )
        if self.head_dim % 4:
            raise ValueError(f"vision head dim {self.head_dim} must be a multiple of 4 (2-D rotary over rows and cols)")
        if self.hidden_act not in VISION_ACTS:
            raise ValueError(f"vision_config.hidden_act {self.hidden_act!r} is not supported: {list(VISION_ACTS)}")
        if self.image_token_id == self.video_token_id:
            raise ValueError(f"image_token_id and video_token_id must differ, both are {self.image_token_id}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Features of one flattened patch: C * TP * PS * PS."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def grid_side(self) -> int:
        """G: the learned position table is G x G (transformers: int(sqrt(num_position_embeddings)))."""
        return math.isqrt(self.num_position_embeddings)


def check_grid(pixel_values: torch.Tensor, grid_thw: torch.Tensor, vision: VisionArch, what: str) -> list[list[int]]:
    """Validate pixel patches against their grid; returns the grid as host ints [[t, h, w], ...].

    Args:
        pixel_values: [P, patch_dim] float. grid_thw: [N, 3] int (frames, rows, cols of patches).
        what: "image" or "video", for the messages.
    Raises:
        ValueError: a missing grid, a bad shape or dtype, rows / cols not divisible by the merge size,
            or P != sum(t * h * w) (both counts named).
    """
    if grid_thw is None:
        raise ValueError(f"{what} pixel values need {what}_grid_thw")
    if grid_thw.dim() != 2 or grid_thw.shape[1] != 3 or grid_thw.is_floating_point():
        raise ValueError(f"{what}_grid_thw must be [N, 3] int, got {tuple(grid_thw.shape)} {grid_thw.dtype}")
    if pixel_values.dim() != 2 or pixel_values.shape[1] != vision.patch_dim or not pixel_values.is_floating_point():
        raise ValueError(
            f"{what} pixel values must be [patches, {vision.patch_dim}] float (C * TP * PS * PS), got "
            f"{tuple(pixel_values.shape)} {pixel_values.dtype}"
        )
    grid = grid_thw.tolist()
    m = vision.spatial_merge_size
    for t, h, w in grid:
        if t <= 0 or h <= 0 or w <= 0 or h % m or w % m:
            raise ValueError(f"{what}_grid_thw row {[t, h, w]}: sizes must be positive, rows and cols multiples of {m}")
    patches = sum(t * h * w for t, h, w in grid)
    if patches != pixel_values.shape[0]:
        raise ValueError(
            f"{what}_grid_thw {grid} covers {patches} patches but {what} pixel values hold {pixel_values.shape[0]}"
        )
    return grid


def frame_offsets(grid: list[list[int]]) -> tuple[int, ...]:
    """[frames + 1] offsets as host ints: each frame (h * w patches) is one attention sequence."""
    offsets = [0]
    for t, h, w in grid:
        offsets += [offsets[-1] + (i + 1) * h * w for i in range(t)]
    return tuple(offsets)


def patch_positions(grid: list[list[int]], merge: int, device) -> torch.Tensor:
    """(row, col) of every patch in the processor's order (merge windows of merge x merge patches,
    row-major inside and between windows, frames repeated): [P, 2] int64."""
    out = []
    for t, h, w in grid:
        rows = torch.arange(h, device=device).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        cols = torch.arange(w, device=device).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        # [h/m, m, w/m, m] -> window-major [h/m, w/m, m, m]
        rc = torch.stack([rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()], dim=-1)
        out.append(rc.repeat(t, 1))
    return torch.cat(out)


def bilinear_position_weights(
    grid: list[list[int]], side: int, merge: int, dtype: torch.dtype, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear interpolation of a side x side position table onto each image's h x w patches.

    Returns:
        index: [4, P] int64 table rows of the four corners (floor/floor, floor/ceil, ceil/floor,
            ceil/ceil), weight: [4, P] in `dtype` (transformers computes them in fp32), both in the
            processor's patch order.
    """
    index, weight = [], []
    for t, h, w in grid:
        hs = torch.linspace(0, side - 1, h, dtype=dtype, device=device)
        ws = torch.linspace(0, side - 1, w, dtype=dtype, device=device)
        h0, w0 = hs.int(), ws.int()
        h1, w1 = (h0 + 1).clamp(max=side - 1), (w0 + 1).clamp(max=side - 1)
        fh, fw = (hs - h0)[:, None], (ws - w0)[None, :]
        corners = torch.stack(
            [
                (h0[:, None] * side + w0[None, :]),
                (h0[:, None] * side + w1[None, :]),
                (h1[:, None] * side + w0[None, :]),
                (h1[:, None] * side + w1[None, :]),
            ]
        ).flatten(1)  # [4, h * w] row-major
        weights = torch.stack([(1 - fh) * (1 - fw), (1 - fh) * fw, fh * (1 - fw), fh * fw]).flatten(1)
        pos = patch_positions([[1, h, w]], merge, device)
        order = (pos[:, 0] * w + pos[:, 1]).repeat(t)
        index.append(corners[:, order].long())
        weight.append(weights[:, order])
    return torch.cat(index, dim=1), torch.cat(weight, dim=1)


class PatchEmbed(nn.Module):
    """[P, C * TP * PS * PS] -> [P, DV]; `proj` holds transformers' Conv3d weight [DV, C, TP, PS, PS]."""

    def __init__(self, vision: VisionArch, factory: dict):
        super().__init__()
        kernel = (vision.temporal_patch_size, vision.patch_size, vision.patch_size)
        self.proj = nn.Conv3d(vision.in_channels, vision.hidden_size, kernel, stride=kernel, bias=True, **factory)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # kernel == stride: the convolution is one dot product per patch
        w = self.proj.weight
        return F.linear(pixels.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)


class VisionAttention(nn.Module):
    """Bidirectional attention within each frame, 2-D rotary on q and k; qkv [DV, 3 DV] (q | k | v,
    head-major each), proj [DV, DV]."""

    def __init__(self, vision: VisionArch, ops: ResolvedOps, factory: dict):
        super().__init__()
        D = vision.hidden_size
        self.num_heads, self.head_dim = vision.num_heads, vision.head_dim
        self.qkv = nn.Linear(D, 3 * D, bias=True, **factory)
        self.proj = nn.Linear(D, D, bias=True, **factory)
        self.ops = ops

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor, frames: tuple[int, ...]
    ) -> torch.Tensor:
        """x: [P, DV]; cos/sin: [1, P, K]; cu_seqlens: [frames + 1], `frames` the same as host ints.
        Returns [P, DV]."""
        P = x.shape[0]
        q, k, v = self.qkv(x).view(1, P, 3, self.num_heads, self.head_dim).unbind(2)
        q, k = self.ops.rope(q, k, cos, sin)
        o = self.ops.attention(
            q, k, v, scale=self.head_dim**-0.5, cu_seqlens=cu_seqlens, causal=False, cu_seqlens_cpu=frames
        )
        return self.proj(o.reshape(P, -1))


class VisionMLP(nn.Module):
    """linear_fc2(gelu(linear_fc1(x))), both with bias."""

    def __init__(self, dim: int, hidden: int, out: int, approximate: str, factory: dict):
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden, bias=True, **factory)
        self.linear_fc2 = nn.Linear(hidden, out, bias=True, **factory)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class VisionBlock(nn.Module):
    """x + attn(norm1(x)), then + mlp(norm2(x)). The unit for fully_shard and activation checkpointing."""

    def __init__(self, vision: VisionArch, ops: ResolvedOps, factory: dict):
        super().__init__()
        D = vision.hidden_size
        self.norm1 = nn.LayerNorm(D, eps=LAYER_NORM_EPS, **factory)
        self.norm2 = nn.LayerNorm(D, eps=LAYER_NORM_EPS, **factory)
        self.attn = VisionAttention(vision, ops, factory)
        self.mlp = VisionMLP(D, vision.intermediate_size, D, VISION_ACTS[vision.hidden_act], factory)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor, frames: tuple[int, ...]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, cu_seqlens, frames)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm per patch, then each merge window's SM * SM patches concatenated -> out_hidden_size."""

    def __init__(self, vision: VisionArch, factory: dict):
        super().__init__()
        self.merged = vision.hidden_size * vision.spatial_merge_size**2
        self.norm = nn.LayerNorm(vision.hidden_size, eps=LAYER_NORM_EPS, **factory)
        self.linear_fc1 = nn.Linear(self.merged, self.merged, bias=True, **factory)
        self.linear_fc2 = nn.Linear(self.merged, vision.out_hidden_size, bias=True, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [P, DV] -> [P / SM^2, out_hidden_size]."""
        x = self.norm(x).reshape(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionModel(nn.Module):
    """patch_embed + pos_embed -> blocks -> merger; parameter names equal transformers' `model.visual`."""

    def __init__(self, vision: VisionArch, ops: ResolvedOps, factory: dict):
        super().__init__()
        self.vision = vision
        self.patch_embed = PatchEmbed(vision, factory)
        self.pos_embed = nn.Embedding(vision.num_position_embeddings, vision.hidden_size, **factory)
        self.blocks = nn.ModuleList(VisionBlock(vision, ops, factory) for _ in range(vision.depth))
        self.merger = PatchMerger(vision, factory)

    def rotary(self, grid: list[list[int]], dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [1, P, K] in `dtype`, computed in fp32 (fp64 for an fp64 model): frequencies
        [row * inv_freq | col * inv_freq] over K / 2, repeated twice (rotate_half layout)."""
        cd = torch.float64 if dtype == torch.float64 else torch.float32
        inv_freq = rope_inv_freq(self.vision.head_dim // 2, VISION_ROPE_THETA, dtype=cd, device=device)  # [K / 4]
        pos = patch_positions(grid, self.vision.spatial_merge_size, device).to(cd)
        freqs = (pos[..., None] * inv_freq).flatten(1)  # [P, K / 2]
        emb = torch.cat((freqs, freqs), dim=-1)[None]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, what: str = "image") -> torch.Tensor:
        """pixel_values: [P, C * TP * PS * PS]; grid_thw: [N, 3] int. Returns the merged features
        [P / SM^2, out_hidden_size] in the model dtype, images in order.

        Raises:
            ValueError: the grid does not match the pixel patches (see `check_grid`).
        """
        v = self.vision
        grid = check_grid(pixel_values, grid_thw, v, what)
        dtype, device = self.pos_embed.weight.dtype, self.pos_embed.weight.device
        x = self.patch_embed(pixel_values.to(device))
        cd = torch.float64 if dtype == torch.float64 else torch.float32
        index, weight = bilinear_position_weights(grid, v.grid_side, v.spatial_merge_size, cd, device)
        x = x + (self.pos_embed(index) * weight[..., None]).sum(0).to(dtype)
        cos, sin = self.rotary(grid, dtype, device)
        frames = frame_offsets(grid)
        cu_seqlens = offsets_tensor(frames, device)
        for block in self.blocks:
            x = block(x, cos, sin, cu_seqlens, frames)
        return self.merger(x)
