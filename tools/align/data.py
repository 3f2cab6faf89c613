"""Alignment presets (an HF config + random weights from a seed), the deterministic RL batch stream,
verl batch dumps, and the verl layouts a backend feeds its model.

A preset names a model family, the HF config fields of a small model and the shape of the batch
stream. `create_model_dir` writes an HF folder (config.json + safetensors) with weights drawn by
transformers' own initialisation under a fixed seed, so every backend loads the same HF weights.

The stream is a list of verl rollout batches in verl's left/right-padded layout (what
`DataProto.batch` holds after rollout + advantage estimation):

    prompts [B, P] left-padded, responses [B, R] right-padded, input_ids [B, P+R],
    attention_mask [B, P+R], position_ids [B, P+R], response_mask [B, R],
    advantages [B, R] fp32 (verl's GRPO outcome advantage over groups of `group_size`),
    old_log_probs [B, R] fp32 (filled in by the align tool from the fp64 reference at θ0,
    or taken from a verl batch dump).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

PAD_ID = 0
BATCH_KEYS = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask", "advantages")


@dataclass(frozen=True)
class StreamSpec:
    """Shape of one RL step's batch: `num_prompts` prompts x `group_size` responses each,
    lengths drawn uniformly from the inclusive ranges."""

    num_prompts: int = 2
    group_size: int = 4
    prompt_len: tuple[int, int] = (3, 12)
    response_len: tuple[int, int] = (2, 20)
    # vision-language presets: prompt i holds one image of grid image_grids[i % len] ((t, h, w) in
    # patches; () = a text prompt), as `<vision_start> placeholders <vision_end>` after its first tokens
    image_grids: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self):
        if self.num_prompts < 1 or self.group_size < 1:
            raise ValueError(f"num_prompts and group_size must be >= 1, got {self.num_prompts}, {self.group_size}")
        for name in ("prompt_len", "response_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be (lo, hi) with 1 <= lo <= hi, got {(lo, hi)}")
        for grid in self.image_grids:
            if grid and (len(grid) != 3 or min(grid) < 1):
                raise ValueError(f"image_grids entries are (t, h, w) >= 1 or (), got {grid}")

    @property
    def batch_size(self) -> int:
        return self.num_prompts * self.group_size


@dataclass(frozen=True)
class Preset:
    """A named model + stream. `config` holds the HF config fields of `family`."""

    name: str
    family: str  # "qwen3_5_moe" | "qwen3_moe" | "qwen3_5_moe_vl" (config: text, vision, placeholder ids)
    config: dict = field(hash=False)
    stream: StreamSpec = StreamSpec()
    needs_gpu: bool = False
    world_size: int = 2  # ranks for the distributed backends


_TINY_Q35 = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=4,  # 3 GatedDeltaNet + 1 full attention (full_attention_interval 4)
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    initializer_range=0.05,
)
_TINY_Q3 = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    initializer_range=0.05,
)
_MID_Q3 = dict(  # ~0.7B parameters: fits fp64 + Adam on one 141 GB GPU
    vocab_size=32000,
    hidden_size=1024,
    num_hidden_layers=12,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    intermediate_size=2816,
    moe_intermediate_size=256,
    num_experts=64,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    initializer_range=0.02,
)
_TINY_VISION = dict(  # 2 ViT blocks of width 16, 2x2 merge: one merged token per 4 patches
    depth=2,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    out_hidden_size=64,  # the text model's hidden size
    patch_size=2,
    temporal_patch_size=2,
    spatial_merge_size=2,
    in_channels=3,
    num_position_embeddings=16,
    initializer_range=0.2,
)
_TINY_Q35_VL = dict(  # placeholder ids at the top of the vocabulary: the stream's text ids stay below them
    text=_TINY_Q35,
    vision=_TINY_VISION,
    image_token_id=511,
    video_token_id=510,
    vision_start_token_id=508,
    vision_end_token_id=509,
)
_MID_Q35 = dict(  # ~0.5B parameters (experts 0.40B): fp64 + Adam and three bf16 backends share one 141 GB GPU
    vocab_size=32000,  # documented smaller vocabulary (the released models have 248k); the stream is random ids
    hidden_size=1024,
    num_hidden_layers=8,  # 6 GatedDeltaNet + 2 full attention (full_attention_interval 4, as released)
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,  # 25% rotary: 32 dims
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_num_key_heads=8,
    linear_num_value_heads=16,
    moe_intermediate_size=256,
    shared_expert_intermediate_size=256,
    num_experts=64,
    num_experts_per_tok=8,
    initializer_range=0.02,
)

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("tiny-qwen3.5-moe", "qwen3_5_moe", _TINY_Q35),
        Preset("tiny-qwen3-moe", "qwen3_moe", _TINY_Q3),
        Preset(  # images in the stream (a text prompt among them: ranks without images too)
            "tiny-qwen3.5-moe-vl",
            "qwen3_5_moe_vl",
            _TINY_Q35_VL,
            StreamSpec(image_grids=((1, 4, 4), ()), prompt_len=(3, 8), response_len=(2, 12)),
        ),
        Preset(
            "mid-qwen3-moe",
            "qwen3_moe",
            _MID_Q3,
            StreamSpec(num_prompts=4, group_size=4, prompt_len=(32, 256), response_len=(64, 512)),
            needs_gpu=True,
            world_size=1,
        ),
        Preset(  # sized so K=40 GRPO steps of four backends sharing one 141 GB GPU fit a 10-minute job
            "mid-qwen3.5-moe",
            "qwen3_5_moe",
            _MID_Q35,
            StreamSpec(num_prompts=4, group_size=4, prompt_len=(32, 128), response_len=(64, 256)),
            needs_gpu=True,
            world_size=1,
        ),
    )
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choices: {sorted(PRESETS)}")
    return PRESETS[name]


def hf_config(preset: Preset):
    """The transformers config object of `preset`."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeTextConfig, Qwen3MoeConfig

    if preset.family == "qwen3_5_moe_vl":
        c = preset.config
        text = Qwen3_5MoeTextConfig(**c["text"]).to_dict()
        # 25% of head_dim 16 rotates: 2 frequencies, one each for t and h (interleaved, as released)
        text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [1, 1, 0], "mrope_interleaved": True}
        ids = {k: v for k, v in c.items() if k.endswith("_token_id")}
        return Qwen3_5MoeConfig(text_config=text, vision_config=c["vision"], **ids)
    cls = {"qwen3_5_moe": Qwen3_5MoeTextConfig, "qwen3_moe": Qwen3MoeConfig}[preset.family]
    return cls(**preset.config)


@dataclass(frozen=True)
class VisionTokens:
    """What the stream needs to put images in prompts: the placeholder ids, the tower's merge size and
    the width of one pixel patch (channels x temporal patch x patch x patch)."""

    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    spatial_merge_size: int
    patch_dim: int

    @classmethod
    def of(cls, config) -> VisionTokens | None:
        """The vision tokens of an HF config, or None for a text model."""
        v = getattr(config, "vision_config", None)
        if v is None:
            return None
        return cls(
            config.image_token_id,
            config.video_token_id,
            config.vision_start_token_id,
            config.vision_end_token_id,
            v.spatial_merge_size,
            v.in_channels * v.temporal_patch_size * v.patch_size**2,
        )

    @property
    def first_special_id(self) -> int:
        return min(self.image_token_id, self.video_token_id, self.vision_start_token_id, self.vision_end_token_id)


def text_vocab_size(config) -> int:
    """vocab_size of an HF config (a vision-language one keeps it in text_config)."""
    return getattr(config, "text_config", config).vocab_size


def create_model_dir(preset: Preset, seed: int, path: str | Path) -> Path:
    """Write an HF folder for `preset` with transformers' initialisation under `seed` (fp32 weights)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = Path(path)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if preset.family == "qwen3_5_moe_vl":
            from transformers import Qwen3_5MoeForConditionalGeneration

            model = Qwen3_5MoeForConditionalGeneration._from_config(hf_config(preset), dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_config(hf_config(preset), dtype=torch.float32)
    model.save_pretrained(path)
    return path


def label_slug(label: str) -> str:
    """A backend label as a file name."""
    return label.replace(":", "_").replace("=", "-").replace("/", "_")


def model_dir_for(spec, model_dir: str | Path, scratch: Path) -> Path:
    """`model_dir`, or a copy of it whose config.json carries the `BackendSpec`'s `cfg.` overrides
    (weights linked, not copied)."""
    if not spec.overrides:
        return Path(model_dir)
    src, dst = Path(model_dir), scratch / label_slug(spec.label)
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    config = json.loads((src / "config.json").read_text())
    for path, value in spec.overrides:
        *parents, leaf = path.split(".")
        node = config
        for p in parents:
            if not isinstance(node.get(p), dict):
                raise ValueError(f"cfg.{path}: {p!r} is not a dict in {src / 'config.json'}")
            node = node[p]
        if leaf not in node:
            raise ValueError(f"cfg.{path}: no field {leaf!r} in {src / 'config.json'}")
        node[leaf] = json.loads(value)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f.resolve())
    return dst


def _grpo_advantages(scores: torch.Tensor, response_mask: torch.Tensor, group_size: int) -> torch.Tensor:
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    rewards = torch.zeros(response_mask.shape, dtype=torch.float32)
    last = response_mask.sum(-1).long() - 1
    rewards[torch.arange(len(scores)), last] = scores  # verl puts the outcome reward on the last token
    index = np.repeat(np.arange(len(scores) // group_size), group_size)
    advantages, _ = compute_grpo_outcome_advantage(rewards, response_mask.float(), index)
    return advantages


def rollout_batch(
    prompts: torch.Tensor, responses: torch.Tensor, prompt_lengths: torch.Tensor, response_lengths: torch.Tensor
) -> dict[str, torch.Tensor]:
    """verl's padded rollout layout (what `DataProto.batch` holds after rollout) of token rows.

    prompts: [B, P] int64, the real tokens at the right end (left padding); responses: [B, R] int64,
    the real tokens first (right padding); prompt_lengths, response_lengths: [B] real tokens per row.
    Returns prompts, responses (padded slots set to PAD_ID), input_ids [B, P+R], attention_mask
    [B, P+R], position_ids [B, P+R] (0 on left padding) and response_mask [B, R], all int64."""
    p, r = prompts.shape[1], responses.shape[1]
    prompt_mask = torch.arange(p) >= (p - prompt_lengths)[:, None]
    response_mask = torch.arange(r) < response_lengths[:, None]
    prompts, responses = prompts.masked_fill(~prompt_mask, PAD_ID), responses.masked_fill(~response_mask, PAD_ID)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).long()
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp_min(0),
        "response_mask": response_mask.long(),
    }


def make_batch(
    spec: StreamSpec, vocab_size: int, generator: torch.Generator, vision: VisionTokens | None = None
) -> dict[str, torch.Tensor]:
    """One padded verl rollout batch of `spec.batch_size` sequences (no old_log_probs yet). With
    `spec.image_grids` (and `vision`): the prompts' images, `multi_modal_inputs` per row as verl's agent
    loop writes it, and verl's 4-row position ids [B, 4, P+R] (text row, then the 3 mRoPE rows)."""
    if spec.image_grids and vision is None:
        raise ValueError("a stream with image_grids needs a vision-language model (its placeholder ids)")
    text_vocab = vision.first_special_id if vision is not None else vocab_size

    def lengths(lo_hi, n):
        lo, hi = lo_hi
        return torch.randint(lo, hi + 1, (n,), generator=generator)

    def text(n):
        return torch.randint(1, text_vocab, (n,), generator=generator)

    b, g = spec.batch_size, spec.group_size
    prompt_tokens, media = [], []
    for i, n in enumerate(lengths(spec.prompt_len, spec.num_prompts).tolist()):
        grid = spec.image_grids[i % len(spec.image_grids)] if spec.image_grids else ()
        if not grid:
            prompt_tokens.append(text(n))
            media.append({})
            continue
        t, h, w = grid
        placeholders = torch.full((t * h * w // vision.spatial_merge_size**2,), vision.image_token_id)
        start, end = torch.tensor([vision.vision_start_token_id]), torch.tensor([vision.vision_end_token_id])
        head = text(min(n, 2))
        prompt_tokens.append(torch.cat([head, start, placeholders, end, text(n - head.numel())]))
        media.append(
            {
                "pixel_values": torch.randn(t * h * w, vision.patch_dim, generator=generator),
                "image_grid_thw": torch.tensor([grid]),
                "images_seqlens": torch.tensor([h * w] * t),
            }
        )
    p_len = torch.tensor([x.numel() for x in prompt_tokens]).repeat_interleave(g)
    r_len = lengths(spec.response_len, b)
    p_max, r_max = int(p_len.max()), int(r_len.max())
    prompts = torch.full((b, p_max), PAD_ID, dtype=torch.long)
    responses = torch.full((b, r_max), PAD_ID, dtype=torch.long)
    for i, tokens in enumerate(prompt_tokens):
        prompts[i * g : (i + 1) * g, p_max - tokens.numel() :] = tokens  # the same prompt for the whole group
    for i in range(b):
        n = int(r_len[i])
        responses[i, :n] = text(n)
    scores = torch.randn(b, generator=generator)  # continuous rewards: no group has zero advantage
    batch = rollout_batch(prompts, responses, p_len, r_len)
    batch["advantages"] = _grpo_advantages(scores, batch["response_mask"], g)
    if spec.image_grids:
        rows = [m for m in media for _ in range(g)]
        batch["position_ids"] = _four_row_positions(batch, rows, vision)
        batch["multi_modal_inputs"] = rows
    return batch


def _four_row_positions(batch: dict, media: list[dict], vision: VisionTokens) -> torch.Tensor:
    """verl's [B, 4, L] position ids of a padded multimodal batch: the text row 0..n-1 over each row's
    valid tokens, then the mRoPE rows of transformers' `get_rope_index` (0 on padding)."""
    from verl_moe.models import mrope_position_ids

    mask = batch["attention_mask"].bool()
    out = torch.zeros(mask.shape[0], 4, mask.shape[1], dtype=torch.long)
    for i, m in enumerate(media):
        ids = batch["input_ids"][i, mask[i]][None]
        rope, _ = mrope_position_ids(
            ids, vision.image_token_id, vision.video_token_id, vision.spatial_merge_size, m.get("image_grid_thw")
        )
        out[i, 0, mask[i]] = torch.arange(ids.shape[1])
        out[i, 1:, mask[i]] = rope[:, 0]
    return out


def make_stream(
    spec: StreamSpec, vocab_size: int, steps: int, seed: int, vision: VisionTokens | None = None
) -> list[dict[str, torch.Tensor]]:
    """`steps` batches, deterministic in `seed` (one per optimizer step)."""
    generator = torch.Generator().manual_seed(seed)
    return [make_batch(spec, vocab_size, generator, vision) for _ in range(steps)]


def save_batch_dump(batch, path: str | Path) -> Path:
    """Write a batch (a dict / TensorDict of padded tensors, or a verl `DataProto`) as safetensors,
    the format `load_batch_dump` reads without unpickling."""
    from safetensors.torch import save_file

    batch = getattr(batch, "batch", batch)  # DataProto -> its TensorDict
    save_file({k: torch.as_tensor(batch[k]).contiguous() for k in batch.keys()}, str(path))
    return Path(path)


def _is_safetensors(path: Path) -> bool:
    """A safetensors file starts with the 8-byte little-endian length of a JSON header, then `{`."""
    with open(path, "rb") as f:
        head = f.read(9)
    if len(head) < 9 or head[8:9] != b"{":
        return False
    return 0 < int.from_bytes(head[:8], "little") <= path.stat().st_size - 8


def _read_dump(path: Path, trust_pickle: bool):
    """The object in a batch dump: safetensors and plain-tensor torch files load without running
    code; any other pickle (verl's `DataProto.save_to_disk`) needs `trust_pickle`."""
    import warnings

    if _is_safetensors(path):
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except Exception as e:
            raise ValueError(f"batch dump {path}: damaged safetensors file ({e})") from e
    with open(path, "rb") as f:
        head = f.read(4)
    # by the first bytes: zipfile.is_zipfile would also accept a pickle that embeds a zip (DataProto does)
    is_zip = head == b"PK\x03\x04"  # torch.save's zip format
    is_pickle = head[:1] == b"\x80"  # the PROTO opcode that starts every pickle of protocol >= 2
    if not (is_zip or is_pickle):
        raise ValueError(f"batch dump {path} is not safetensors, a torch file or a pickle")
    try:  # torch's weights-only unpickler: tensors and plain containers, no other global is resolved
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "pickle protocol 4": the restricted unpickler still refuses safely
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception:
        if not trust_pickle:
            kind = "a torch file holding objects other than tensors" if is_zip else "a pickle (verl's DataProto)"
            raise ValueError(
                f"batch dump {path} is {kind}: loading it runs code stored in the file; pass --trust-pickle "
                "if you made or trust it, or re-save it as safetensors (verl_moe.tools.align.data.save_batch_dump)"
            ) from None
    import pickle

    try:
        if is_zip:
            return torch.load(path, map_location="cpu", weights_only=False)
        with open(path, "rb") as f:
            return pickle.load(f)
    except Exception as e:
        raise ValueError(f"batch dump {path}: cannot be read ({type(e).__name__}: {e})") from e


def load_batch_dump(path: str | Path, steps: int, trust_pickle: bool = False) -> list[dict[str, torch.Tensor]]:
    """Split a verl batch dump into `steps` equal mini-batches (as verl splits a rollout batch).

    `path` holds padded tensors with the keys of `BATCH_KEYS` (and `old_log_probs`, kept when
    present) as a safetensors file (`save_batch_dump`) or a dict of tensors saved with
    `torch.save`; both load without running code. A verl `DataProto` written by
    `DataProto.save_to_disk` (a pickle), or a torch-saved TensorDict, loads only with
    `trust_pickle=True`: unpickling runs code stored in the file.

    Raises:
        FileNotFoundError: no file at `path`.
        ValueError: a pickle without `trust_pickle`, a damaged file, missing keys, keys of
            different lengths, or a batch that does not split into `steps`.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"batch dump {path} does not exist")
    obj = _read_dump(path, trust_pickle)
    batch = getattr(obj, "batch", obj)  # DataProto -> its TensorDict
    if not hasattr(batch, "keys"):
        raise ValueError(f"batch dump {path} holds a {type(obj).__name__}, not a dict of tensors or a DataProto")
    missing = [k for k in BATCH_KEYS if k not in batch.keys()]
    if missing:
        raise ValueError(f"{path}: batch dump lacks {missing}; it needs {list(BATCH_KEYS)}")
    keys = [*BATCH_KEYS, *(["old_log_probs"] if "old_log_probs" in batch.keys() else [])]
    n = batch["input_ids"].shape[0]
    lengths = {k: int(torch.as_tensor(batch[k]).shape[0]) for k in keys}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"{path}: batch dump keys hold different numbers of sequences: {lengths}")
    if steps < 1 or n % steps:
        raise ValueError(f"{path}: {n} sequences do not split into {steps} equal mini-batches")
    size = n // steps
    return [{k: torch.as_tensor(batch[k])[i * size : (i + 1) * size].clone() for k in keys} for i in range(steps)]


def to_verl(batch: dict[str, torch.Tensor], temperature: float, global_batch_size: int):
    """A padded rollout batch -> verl's no-padding TensorDict (nested input_ids / position_ids / loss_mask)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    non_tensor = {"temperature": temperature, "global_batch_size": global_batch_size}
    if "multi_modal_inputs" not in batch:
        return left_right_2_no_padding(tu.get_tensordict(dict(batch), non_tensor_dict=non_tensor))
    # verl's multimodal layout: multi_modal_inputs rides per sample, as DataProto's non-tensor batch holds it
    from verl import DataProto

    tensors = {k: v for k, v in batch.items() if k != "multi_modal_inputs"}
    data = DataProto.from_single_dict(tensors)
    data.non_tensor_batch["multi_modal_inputs"] = np.array(batch["multi_modal_inputs"], dtype=object)
    td = data.to_tensordict()
    tu.assign_non_tensor(td, **non_tensor)
    return left_right_2_no_padding(td)


def rank_batch(batch: dict[str, torch.Tensor], step: int, rank: int, world: int, temperature: float):
    """This rank's contiguous block of a padded batch's rows (as verl dispatches), in verl's
    no-padding layout; ValueError when the rows do not split evenly over the ranks."""
    n = batch["input_ids"].shape[0]
    if n % world:
        raise ValueError(f"step {step}: {n} sequences do not split over {world} ranks")
    rows = slice(rank * n // world, (rank + 1) * n // world)
    return to_verl({key: v[rows] for key, v in batch.items()}, temperature, global_batch_size=n)
