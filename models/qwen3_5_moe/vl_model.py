"""Qwen3.5-MoE vision-language model: the vision tower beside the text decoder, image and video
features placed at their placeholder tokens (transformers' `Qwen3_5MoeForConditionalGeneration`).

Module tree and parameter names equal transformers': `model.visual.*` (vision.py),
`model.language_model.{embed_tokens, layers, norm}` (the shared text decoder of causal_lm.py),
`lm_head`. Position ids for images come from `MoeVisionLM.rope_index` (rope_index.py).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from ...ops.varlen import HostOffsets
from ..arch import ArchConfig
from ..causal_lm import (
    MoeCausalLM,
    MoeModelOutput,
    MoeTextModel,
    MultiTokenPredictor,
    init_modules,
    resolve_ops,
    zero_padding_embedding,
)
from ..layers import ResolvedOps
from ..ops_config import OpsConfig
from ..registry import ModelSpec
from .rope_index import mrope_position_ids
from .vision import VisionArch, VisionModel, check_grid


class VisionLanguageModel(nn.Module):
    """transformers' `model.`: the vision tower `visual` and the text decoder `language_model`."""

    def __init__(self, arch: ArchConfig, vision: VisionArch, ops: ResolvedOps, factory: dict):
        super().__init__()
        self.visual = VisionModel(vision, ops, factory)
        self.language_model = MoeTextModel(arch, ops, factory)


class MoeVisionLM(nn.Module):
    """Qwen3.5-MoE with its vision tower, on verl_moe ops.

    forward(input_ids [B, T] long, position_ids [B, T], [3, B, T] (see `rope_index`) or [4, B, T] (a
    text row, then the three mRoPE rows: verl's layout; the text row is dropped, as transformers does) long,
    cu_seqlens [N+1] int or None, pixel_values [P, C*TP*PS*PS] float or None, image_grid_thw [N_img, 3]
    int or None, pixel_values_videos / video_grid_thw the same for videos, output_router_logits=False,
    cu_seqlens_cpu=None: cu_seqlens as host ints, as `MoeCausalLM`) -> MoeModelOutput (final hidden
    states [B, T, D] after the norm, as `MoeCausalLM`). The images of the whole batch (rows in order,
    or the packed sequences of one row in order) arrive together; their features replace the image
    placeholder tokens in reading order. Logits only on request:
    `model.logits(hidden)`.
    """

    def __init__(
        self, hf_config, spec: ModelSpec, arch: ArchConfig, vision: VisionArch, ops: ResolvedOps, factory: dict
    ):
        super().__init__()
        self.config, self.spec, self.arch, self.vision = hf_config, spec, arch, vision
        self.model = VisionLanguageModel(arch, vision, ops, factory)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False, **factory)
        self.ops = ops
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.model.language_model.embed_tokens.weight
        if arch.mtp_num_hidden_layers:  # on disk `mtp.*`, beside `model.` (not under the language model)
            self.mtp = MultiTokenPredictor(arch, ops, factory)
        self.sequence_parallel = None
        self.tower_every_forward = False

    def set_tower_every_forward(self, on: bool) -> None:
        """When on, every forward runs the vision tower once (images and videos in one pass), on a dummy
        image of one merge window where the batch has neither, adding its features times zero: a sharded
        tower (its own FSDP units, `models/fsdp_plan.py`) then all-gathers and reduce-scatters once per
        forward on every rank, whatever each rank's micro-batch holds."""
        self.tower_every_forward = on

    # The text decoder's switches and input checks are MoeCausalLM's (they walk this module tree).
    set_sequence_parallel = MoeCausalLM.set_sequence_parallel
    set_expert_parallel = MoeCausalLM.set_expert_parallel
    check_inputs = MoeCausalLM.check_inputs
    logits = MoeCausalLM.logits
    mtp_hidden_states = MoeCausalLM.mtp_hidden_states

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        output_router_logits: bool = False,
        cu_seqlens_cpu: HostOffsets | None = None,
    ) -> MoeModelOutput:
        """See the class docstring. Raises ValueError on bad inputs (see `check_inputs`), a grid that
        does not match its pixel patches, or placeholder tokens that do not match the features (both
        counts named). Under sequence parallelism every rank gets the micro-batch's whole pixels and
        grids with its share of the tokens, runs the tower on every image and keeps the features of its
        own placeholders."""
        if position_ids.dim() == 3 and position_ids.shape[0] == 4:
            position_ids = position_ids[1:]
        self.check_inputs(input_ids, position_ids, cu_seqlens, cu_seqlens_cpu)
        lm = self.model.language_model
        v = self.vision
        media = (
            ("image", pixel_values, image_grid_thw, v.image_token_id),
            ("video", pixel_values_videos, video_grid_thw, v.video_token_id),
        )
        embeds = self._place_media(lm.embed_tokens(input_ids), input_ids, media)
        return lm(
            input_ids,
            position_ids,
            cu_seqlens,
            output_router_logits,
            inputs_embeds=embeds,
            cu_seqlens_cpu=cu_seqlens_cpu,
        )

    def _place_media(self, embeds: torch.Tensor, input_ids: torch.Tensor, media: tuple) -> torch.Tensor:
        """embeds [B, T, D] with the tower's features at each modality's placeholders. One tower pass
        over the images and videos together (frames are attended one at a time either way), or, with
        `tower_every_forward` and no media, over a dummy one-window image times zero: a sharded tower then
        all-gathers once per forward on every rank."""
        present = []  # (what, pixels, grid [N, 3], grid as host ints, placeholder id, placeholder mask)
        for what, pixels, grid_thw, token_id in media:
            mask = input_ids == token_id
            if pixels is None:
                if grid_thw is not None:
                    raise ValueError(f"{what}_grid_thw was given without {what} pixel values")
                if mask.any():
                    n = int(mask.sum())
                    raise ValueError(f"{n} {what} placeholder tokens (id {token_id}) but 0 {what} features")
                continue
            grid = check_grid(pixels, grid_thw, self.vision, what)  # here, so a bad grid names its modality
            present.append((what, pixels, grid_thw, grid, token_id, mask))
        if not present:
            if not self.tower_every_forward:
                return embeds
            m = self.vision.spatial_merge_size
            dummy = self.model.visual(embeds.new_zeros(m * m, self.vision.patch_dim), torch.tensor([[1, m, m]]))
            return embeds + 0.0 * dummy.sum().to(embeds.dtype)
        features = self.model.visual(torch.cat([p[1] for p in present]), torch.cat([p[2] for p in present]))
        merge = self.vision.spatial_merge_size**2
        sizes = [sum(t * h * w for t, h, w in p[3]) // merge for p in present]
        for (what, _, _, grid, token_id, mask), part in zip(present, features.split(sizes)):
            placeholders, first = int(mask.sum()), 0
            total = placeholders
            if self.sequence_parallel is not None:
                total, first = self._placeholder_share(placeholders, features.device)
            if total != part.shape[0]:
                raise ValueError(
                    f"{total} {what} placeholder tokens (id {token_id}) but {part.shape[0]} {what} features "
                    f"from {what}_grid_thw {grid}"
                )
            embeds = embeds.masked_scatter(mask.unsqueeze(-1), part[first : first + placeholders].to(embeds.dtype))
        if self.sequence_parallel is not None:  # a share without placeholders still backprops the (sharded) tower
            embeds = embeds + 0.0 * features.sum().to(embeds.dtype)
        return embeds

    def _placeholder_share(self, placeholders: int, device: torch.device) -> tuple[int, int]:
        """Under Ulysses SP the ranks hold contiguous shares of the packed row in rank order
        (`engines.batch.slice_packed`) and each runs the tower on every image: (the group's placeholder
        count, the index of this rank's first placeholder among them)."""
        sp = self.sequence_parallel
        mine = torch.tensor([placeholders], device=device)
        counts = [torch.zeros_like(mine) for _ in range(sp.size)]
        dist.all_gather(counts, mine, group=sp.group)
        counts = [int(c) for c in counts]
        return sum(counts), sum(counts[: sp.rank])

    def rope_index(
        self,
        input_ids: torch.Tensor,
        image_grid_thw: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(position_ids [3, B, T], rope_deltas [S, 1]) for this model's placeholder ids and merge size;
        see `rope_index.mrope_position_ids`."""
        v = self.vision
        return mrope_position_ids(
            input_ids,
            v.image_token_id,
            v.video_token_id,
            v.spatial_merge_size,
            image_grid_thw,
            video_grid_thw,
            cu_seqlens=cu_seqlens,
            attention_mask=attention_mask,
        )

    def tie_weights(self) -> None:
        """Point a tied lm_head at the embedding again (after `to_empty`)."""
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.model.language_model.embed_tokens.weight


def init_weights(model: MoeVisionLM) -> None:
    """`init_modules` with the text config's std for the decoder and lm_head (a tied lm_head, visited
    last in its group, re-initialises the shared embedding), then the vision config's for the tower;
    the embedding's padding row zeroed."""
    mtp = [*model.mtp.modules()] if hasattr(model, "mtp") else []
    init_modules([*model.model.language_model.modules(), *mtp, model.lm_head], model.arch.initializer_range)
    init_modules(model.model.visual.modules(), model.vision.initializer_range)
    zero_padding_embedding(model.model.language_model.embed_tokens)


def build_vision_lm(
    hf_config,
    spec: ModelSpec,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    ops: OpsConfig | Mapping | None = None,
    compute_dtype: torch.dtype | None = None,
) -> MoeVisionLM:
    """A freshly initialised MoeVisionLM for a vision-language config (what `verl_moe.models.build`
    returns for one); compute_dtype as in `causal_lm.build_causal_lm`. Raises ValueError on an unsupported
    config or op choice."""
    arch = spec.arch_config(spec.text_config(hf_config))
    vision = spec.vision_arch(hf_config)
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be floating point, got {dtype}")
    resolved = resolve_ops(OpsConfig.coerce(ops), arch, compute_dtype or dtype)
    model = MoeVisionLM(hf_config, spec, arch, vision, resolved, {"dtype": dtype, "device": torch.device(device)})
    init_weights(model)
    return model
