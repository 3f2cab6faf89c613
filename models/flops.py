"""Model FLOPs of a training step: what verl's MFU (`perf/mfu/actor`) and `verl-moe bench model` divide
by the time and the device's peak.

One token's forward is 2 FLOPs (a multiply and an add) per weight it multiplies, plus what its
sequence costs in the token mixers; backward is twice the forward (gradients of inputs and of
weights), so a training step is 3x the forward, as verl counts. Per part, forward:

- weights (`active_params`): every projection, the router, TOPK of the E routed experts, the shared
  expert and its gate, the GatedDeltaNet's depthwise conv taps, lm_head. Not counted: the embedding
  (a lookup), norms, biases, activations, the GatedDeltaNet's gate parameters (elementwise work);
- full attention (causal): per layer, QK^T and PV over the s (s + 1) / 2 causal pairs of each
  sequence, 2 K FLOPs per pair and query head each: 4 K H s (s + 1) / 2. For long sequences the
  training step's 12 K H s^2 / 2 = 6 K H s^2 per layer is verl's own attention term;
- GatedDeltaNet: the recurrence's three matrix-vector products per token and value head on its
  [K, V] state (read k^T S, the rank-1 delta update, the output q^T S): 6 K V HV per token and
  layer. The chunked kernels do more arithmetic than this; model FLOPs count the model, not the
  algorithm, as attention counts the causal pairs and not the kernel's masked tiles;
- vision tower (Qwen3.5-MoE VL): patch embedding, blocks and merger weights per patch (the merger
  per merged token), plus bidirectional attention inside each frame: 4 DV s^2 per block.

`estimate_tflops` has the signature of verl's `FlopsCounter` table entries; the plugin
(`engines/plugin.py`) puts it there for our model types at `import verl`. Like verl's own entries it takes
any object with the config's fields (`full_config`): a field it lacks takes the transformers config class's
default, and the vision config is read only for a batch with images.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .arch import ArchConfig
from .qwen3_5_moe.vision import VisionArch

TRAIN_FACTOR = 3  # forward + backward (twice the forward)


def _mixer_params(arch: ArchConfig, layer_type: str) -> int:
    D = arch.hidden_size
    if layer_type == "full_attention":
        H, HKV, K = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
        q_out = H * K * (2 if arch.attn_output_gate else 1)  # the output gate rides in q_proj
        return D * q_out + 2 * D * HKV * K + H * K * D
    H, HV = arch.linear_num_key_heads, arch.linear_num_value_heads
    K, V, W = arch.linear_key_head_dim, arch.linear_value_head_dim, arch.linear_conv_kernel_dim
    conv_channels = 2 * H * K + HV * V  # q, k, v go through the conv
    # in_proj_qkv, in_proj_z (output gate), in_proj_b / in_proj_a (beta, decay), conv taps, out_proj
    return D * conv_channels + D * HV * V + 2 * D * HV + conv_channels * W + HV * V * D


def _mlp_params(arch: ArchConfig, mlp_type: str) -> int:
    D = arch.hidden_size
    if mlp_type == "dense":
        return 3 * D * arch.intermediate_size
    routed = arch.num_experts_per_tok * 3 * D * arch.moe_intermediate_size
    shared = 3 * D * arch.shared_expert_intermediate_size + D if arch.shared_expert_intermediate_size else 0
    return arch.num_experts * D + routed + shared  # router logits for every expert, then TOPK experts


def active_params(arch: ArchConfig) -> int:
    """Weights one token multiplies in the decoder and lm_head (routed experts: TOPK of E); see the
    module docstring for what is left out."""
    layers = sum(_mixer_params(arch, t) + _mlp_params(arch, m) for t, m in zip(arch.layer_types, arch.mlp_types))
    return layers + arch.vocab_size * arch.hidden_size


def attention_flops(arch: ArchConfig, seqlens: Iterable[int]) -> int:
    """Forward FLOPs of the full-attention layers' QK^T and PV over causal pairs, for sequences of
    these lengths."""
    pairs = sum(s * (s + 1) // 2 for s in seqlens)
    layers = sum(t == "full_attention" for t in arch.layer_types)
    return layers * 4 * arch.head_dim * arch.num_attention_heads * pairs


def linear_attention_flops(arch: ArchConfig, tokens: int) -> int:
    """Forward FLOPs of the GatedDeltaNet recurrences (the three state products) over `tokens`."""
    layers = sum(t == "linear_attention" for t in arch.layer_types)
    per_token = 6 * arch.linear_key_head_dim * arch.linear_value_head_dim * arch.linear_num_value_heads
    return layers * per_token * tokens


def vision_params(vision: VisionArch) -> tuple[int, int]:
    """(weights each patch multiplies: patch embedding and blocks; weights each merged token
    multiplies: the merger's two projections). The position table is a lookup."""
    DV, I = vision.hidden_size, vision.intermediate_size
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2 * DV
    block = 3 * DV * DV + DV * DV + 2 * DV * I  # qkv, proj, fc1, fc2
    merged = DV * vision.spatial_merge_size**2
    return patch + vision.depth * block, merged * merged + merged * vision.out_hidden_size


def vision_flops(vision: VisionArch, frame_patches: Sequence[int]) -> int:
    """Forward FLOPs of the vision tower over frames of these patch counts (verl's `images_seqlens`:
    rows x cols of each frame, frames of a video one by one)."""
    per_patch, per_merged = vision_params(vision)
    patches = sum(frame_patches)
    attention = vision.depth * 4 * vision.hidden_size * sum(s * s for s in frame_patches)
    return 2 * per_patch * patches + 2 * per_merged * patches // vision.spatial_merge_size**2 + attention


def forward_flops(
    arch: ArchConfig, seqlens: Sequence[int], vision: VisionArch | None = None, frame_patches: Sequence[int] = ()
) -> int:
    """Forward FLOPs of the model over sequences of these lengths (and, for the VL model, frames of
    these patch counts). A training step is `TRAIN_FACTOR` times this."""
    tokens = sum(seqlens)
    flops = 2 * active_params(arch) * tokens + attention_flops(arch, seqlens) + linear_attention_flops(arch, tokens)
    if vision is not None and frame_patches:
        flops += vision_flops(vision, frame_patches)
    return flops


def _fields(obj) -> dict:
    """An object's attributes as keyword arguments; nested plain objects (a vision-language config's
    `text_config` given as a namespace) become dicts, transformers configs stay as they are."""
    from transformers import PretrainedConfig

    if isinstance(obj, PretrainedConfig):
        return obj.to_dict()
    try:
        items = vars(obj).items()
    except TypeError:
        raise ValueError(f"a config for the FLOPs count must carry its fields as attributes, got {obj!r}") from None
    plain = (str, int, float, bool, list, tuple, dict, type(None))
    return {k: v if isinstance(v, plain) or isinstance(v, PretrainedConfig) else _fields(v) for k, v in items}


def full_config(config):
    """`config` as an instance of transformers' config class for its `model_type`: an instance passes
    through; any other object (verl's tests give a plain object holding only the fields verl's count
    reads) is read onto that class, so each field it lacks takes the class's default. A vision-language
    type given without `text_config` is read as verl reads it: its fields are the text config's.

    Raises ValueError (one line) when `config` has no `model_type` transformers knows or the class
    refuses its fields."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = getattr(config, "model_type", None)
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"the FLOPs count needs a config whose model_type transformers knows, got {model_type!r}")
    config_cls = CONFIG_MAPPING[model_type]
    if type(config) is config_cls:
        return config
    fields = _fields(config)
    fields.pop("model_type", None)
    if "text_config" in getattr(config_cls, "sub_configs", {}) and "text_config" not in fields:
        fields = {"text_config": fields, "tie_word_embeddings": fields.get("tie_word_embeddings", False)}
    try:
        return config_cls(**fields)
    except (TypeError, ValueError, StrictDataclassError) as exc:
        raise ValueError(f"{model_type} config for the FLOPs count: {' '.join(str(exc).split())}") from None


def estimate_tflops(config, tokens_sum: int, batch_seqlens: Sequence[int], delta_time: float, **kwargs) -> float:
    """verl's `FlopsCounter` table entry: achieved TFLOP/s of a training step over sequences of
    `batch_seqlens` tokens (`tokens_sum` is their sum) that took `delta_time` seconds, for the HF
    `config` of one of our model types (or any object with its fields: `full_config`); the keyword
    `images_seqlens` (None without images) holds the vision frames' patch counts.

    Raises ValueError (one line) as `full_config` does, or where our spec refuses the config."""
    from .registry import get_spec

    config = full_config(config)
    spec = get_spec(config.model_type)
    images = kwargs.get("images_seqlens")
    arch = spec.arch_config(spec.text_config(config))
    vision = spec.vision_arch(config) if spec.vision_arch is not None and images is not None else None
    frames = [int(s) for s in images] if vision is not None else []
    flops = TRAIN_FACTOR * forward_flops(arch, [int(s) for s in batch_seqlens], vision, frames)
    return flops / delta_time / 1e12
