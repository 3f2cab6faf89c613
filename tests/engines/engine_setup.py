"""Tiny model folder, verl-format batches and the plain-autograd reference for the engine tests."""

from __future__ import annotations

import os
from functools import partial

import torch
import verl_moe.models as vm
from tensordict import TensorDict
from transformers import Qwen3_5MoeTextConfig
from verl import DataProto
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import left_right_2_no_padding
from verl_moe.ops.logprob.reference import logprobs_from_logits_ref
from verl_moe.tools.align.backends.engine import engine_configs
from verl_moe.tools.align.data import rollout_batch

VOCAB = 96


def tiny_config() -> Qwen3_5MoeTextConfig:
    """2 GatedDeltaNet layers + 1 attention layer, 4 experts top-2, untied lm_head."""
    return Qwen3_5MoeTextConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, rms_norm_eps=1e-6, pad_token_id=0, tie_word_embeddings=False,
        architectures=["Qwen3_5MoeForCausalLM"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )  # fmt: skip


def tiny_model(config=None, seed: int = 0) -> vm.MoeCausalLM:
    """A randomly initialised tiny model of `config` (default `tiny_config()`, Qwen3.5-MoE) with its norm
    weights randomised too (around 0 for (1 + w) norms, around 1 for plain ones)."""
    torch.manual_seed(seed)
    model = vm.build(config or tiny_config())
    mean = 0.0 if model.arch.norm_unit_offset else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(mean, 0.2)
    return model


def write_tiny_model(path: str, seed: int = 0, config=None) -> str:
    """An HF folder holding `tiny_model(config, seed)`."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    vm.save_pretrained(tiny_model(config, seed), path)
    return path


def make_batch(
    batch_size: int, prompt_len: int, response_len: int, seed: int, temperature=1.0, valid=None
) -> TensorDict:
    """A verl rollout batch in the engines' format: left-padded prompts, right-padded responses,
    then `left_right_2_no_padding` (nested input_ids / position_ids / loss_mask). A tensor
    `temperature` [batch_size] rides in the batch (per sample), a float in the metadata.
    `valid` = (prompt tokens, response tokens) per sample fixes the lengths (default random, >= 1)."""
    gen = torch.Generator().manual_seed(seed)
    total = prompt_len + response_len
    input_ids = torch.randint(1, VOCAB, (batch_size, total), generator=gen)
    prompt_valid = torch.randint(1, prompt_len + 1, (batch_size,), generator=gen)
    response_valid = torch.randint(1, response_len + 1, (batch_size,), generator=gen)
    if valid is not None:
        prompt_valid, response_valid = torch.tensor(valid[0]), torch.tensor(valid[1])
    batch = rollout_batch(input_ids[:, :prompt_len], input_ids[:, prompt_len:], prompt_valid, response_valid)
    response_mask = batch["response_mask"]
    per_sample = isinstance(temperature, torch.Tensor)
    data = DataProto.from_single_dict(
        {
            "input_ids": batch["input_ids"],  # first, as verl's rollout writes it
            **batch,
            "advantages": torch.randn(batch_size, 1, generator=gen).expand(-1, response_len) * response_mask,
            **({"temperature": temperature.float()} if per_sample else {}),
        },
        meta_info={} if per_sample else {"temperature": temperature},
    )
    return left_right_2_no_padding(data.to_tensordict())


def reference_log_probs(model: vm.MoeCausalLM, data: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain autograd through the spec, one sequence at a time, full fp32 logits: nested
    (log_prob, entropy) [N, j] of each next token (a sequence's last entry is meaningless; verl's
    `no_padding_2_padding` never reads it)."""
    temperature = tu.get_non_tensor_data(data, "temperature", 1.0)
    log_probs, entropies = [], []
    for i, ids in enumerate(data["input_ids"].unbind()):
        pos = data["position_ids"].unbind()[i]
        hidden = model(ids[None], pos[None]).last_hidden_state[0]
        t = temperature[i] if isinstance(temperature, torch.Tensor) else temperature
        labels = torch.cat([ids[1:], ids[:1]])
        log_prob, entropy = logprobs_from_logits_ref(model.logits(hidden).float(), labels, t)
        log_probs.append(log_prob)
        entropies.append(entropy)
    offsets = data["input_ids"].offsets()
    return (
        torch.nested.nested_tensor_from_jagged(torch.cat(log_probs), offsets),
        torch.nested.nested_tensor_from_jagged(torch.cat(entropies), offsets),
    )


def grpo_actor_config(**overrides):
    """verl's ActorConfig with GRPO settings (token-mean, KL loss low_var_kl)."""
    from verl.workers.config import ActorConfig

    kwargs = dict(
        strategy="fsdp2", rollout_n=1, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2,
        use_kl_loss=True, kl_loss_type="low_var_kl", kl_loss_coef=0.01, loss_agg_mode="token-mean",
        clip_ratio=0.2, entropy_coeff=0.0,
    )  # fmt: skip
    kwargs.update(overrides)
    return ActorConfig(**kwargs)


def ppo_loss_fn(actor_config):
    from verl.workers.utils.losses import ppo_loss

    return partial(ppo_loss, config=actor_config)


def build_engine(
    path: str, optimizer: dict | None = None, checkpoint_config=None, model: dict | None = None, **engine_overrides
):
    """MoeFsdp2Engine (through verl's registry) on an HF folder, fp32 compute unless overridden;
    `optimizer` / `model` override FSDPOptimizerConfig (default lr 1e-3) / HFModelConfig fields."""
    engine = dict(
        strategy="fsdp2", mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32"},
        use_dynamic_bsz=False, micro_batch_size_per_gpu=2, infer_micro_batch_size_per_gpu=2,
    )  # fmt: skip
    return _new_engine("fsdp2", path, {**engine, **engine_overrides}, optimizer, checkpoint_config, model)


def build_veomni_engine(path: str, optimizer: dict | None = None, checkpoint_config=None, **engine_overrides):
    """MoeVeOmniEngine (through verl's registry, backend "veomni") on an HF folder: fp32 master
    weights and fp32 compute unless overridden; `optimizer` overrides VeOmniOptimizerConfig
    fields (default lr 1e-3, the same AdamW settings as `build_engine`)."""
    engine = dict(
        mixed_precision=True, param_dtype="fp32", use_dynamic_bsz=False, micro_batch_size_per_gpu=2,
        infer_micro_batch_size_per_gpu=2,
    )  # fmt: skip
    return _new_engine("veomni", path, {**engine, **engine_overrides}, optimizer, checkpoint_config)


def _new_engine(kind: str, path: str, engine: dict, optimizer: dict | None, checkpoint_config, model=None):
    """Our `kind` engine ("fsdp2" | "veomni": which config classes) from verl's EngineRegistry under
    the engine config's strategy, initialised."""
    from verl.workers.engine import EngineRegistry

    model_config, engine_config, optimizer_config = engine_configs(
        kind, path, engine, {"lr": 1e-3, **(optimizer or {})}, model
    )
    engine = EngineRegistry.new(
        model_type="language_model",
        backend=engine_config.strategy,
        model_config=model_config,
        engine_config=engine_config,
        optimizer_config=optimizer_config,
        checkpoint_config=checkpoint_config,
    )
    engine.initialize()
    return engine


def rank_slice(data: TensorDict, rank: int, world_size: int) -> TensorDict:
    """The part of a batch verl's dispatch hands to data-parallel rank `rank` (equal chunks)."""
    return tu.chunk_tensordict(data, world_size)[rank]


def with_ppo_fields(data: TensorDict, reference_lp: torch.Tensor, seed: int) -> TensorDict:
    """Add old_log_probs (reference + noise, so ratios are near 1 and partly clipped) and ref_log_prob."""
    from verl.workers.utils.padding import no_padding_2_padding

    gen = torch.Generator().manual_seed(seed)
    lp = no_padding_2_padding(reference_lp, data).detach()
    data["old_log_probs"] = lp + 0.1 * torch.randn(lp.shape, generator=gen)
    data["ref_log_prob"] = lp + 0.1 * torch.randn(lp.shape, generator=gen)
    return data


def reference_train_step(model, optimizer, data: TensorDict, loss_fn, clip_grad: float) -> tuple[float, float]:
    """One step of plain autograd over the whole batch (one micro-batch, dp_size 1): verl's loss on
    full-logits log-probs, clip_grad_norm_, optimizer.step. Returns (loss, grad norm before clip)."""
    optimizer.zero_grad()
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(data["loss_mask"].sum()), global_batch_size=len(data))
    log_probs, _ = reference_log_probs(model, data)
    loss, _ = loss_fn(model_output={"log_probs": log_probs}, data=data, dp_group=None)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
    optimizer.step()
    return loss.item(), grad_norm.item()


def fixed_ppo_batch(batch: int, prompt: int, response: int, seed: int, rank: int, world_size: int) -> TensorDict:
    """This rank's slice of a training batch whose old / reference log-probs are constants (-4.5 / -4.6),
    in micro-batches of 2 without dynamic batch size."""
    data = make_batch(batch, prompt, response, seed=seed)
    data["old_log_probs"] = torch.full(data["responses"].shape, -4.5)
    data["ref_log_prob"] = torch.full(data["responses"].shape, -4.6)
    local = rank_slice(data, rank, world_size)
    tu.assign_non_tensor(local, global_batch_size=batch, use_dynamic_bsz=False, micro_batch_size_per_gpu=2)
    return local


def check_delta_weight_sync(engine, rank: int, world_size: int, batch: int, prompt: int, response: int) -> None:
    """verl's sharded delta weight sync, with the delta engine's part done by hand: seed the rollout
    with the full vLLM-layout export (in bf16, as a rollout holds it), prime the snapshots, train one
    step, gather every rank's delta entries and write them into the rollout copy. It must equal the
    full export after the step, bit for bit, and some expert slots must have changed."""
    import torch.distributed as dist

    rollout = {name: t.to(torch.bfloat16).clone() for name, t in engine.get_per_tensor_param(layout="vllm")[0]}
    engine.prime_delta_snapshots()
    local = fixed_ppo_batch(batch, prompt, response, 21, rank, world_size)
    with engine.train_mode():
        engine.train_batch(local, ppo_loss_fn(grpo_actor_config()))
    changed = set()
    for slots, dtype, counts, positions, values, group in engine.get_per_tensor_param_delta_shard()[0]:
        assert dtype == "bfloat16" and len(counts) == len(slots) and positions.numel() == values.numel()
        pieces = [None] * dist.get_world_size(group)
        dist.all_gather_object(pieces, (counts, positions, values), group=group)
        for rank_counts, rank_positions, rank_values in pieces if group is not None else pieces[:1]:
            starts = [0, *torch.cumsum(rank_counts, 0).tolist()]
            for s, (slot_name, _) in enumerate(slots):
                lo, hi = starts[s], starts[s + 1]
                rollout[slot_name].view(-1)[rank_positions[lo:hi].long()] = rank_values[lo:hi]
                if hi > lo:
                    changed.add(slot_name)
    updated = {name: t.to(torch.bfloat16) for name, t in engine.get_per_tensor_param(layout="vllm")[0]}
    assert rollout.keys() == updated.keys()
    for name, tensor in updated.items():
        assert torch.equal(rollout[name], tensor), name
    assert any(".experts.0." in name for name in changed) and any("down_proj" in name for name in changed), changed


# ---- vision-language checkpoints and image batches -------------------------------------------

IMAGE, VIDEO, VISION_START, VISION_END = 90, 91, 88, 89
TINY_VISION = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=2,
                   temporal_patch_size=2, spatial_merge_size=2, in_channels=3, num_position_embeddings=16,
                   initializer_range=0.2)  # fmt: skip
PATCH_DIM = 3 * 2 * 2 * 2


def tiny_vl_config():
    """transformers' Qwen3_5MoeConfig around `tiny_config()` (2 ViT blocks of width 16, merge 2),
    placeholder ids inside the 96-token vocabulary."""
    from transformers import Qwen3_5MoeConfig

    text = tiny_config().to_dict()
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [1, 1, 0], "mrope_interleaved": True}
    return Qwen3_5MoeConfig(
        text_config=text, vision_config=TINY_VISION, image_token_id=IMAGE, video_token_id=VIDEO,
        vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
    )  # fmt: skip


def write_tiny_vl_model(path: str, seed: int = 0) -> str:
    """An HF folder holding a randomly initialised tiny Qwen3.5-MoE vision-language model (norms and
    vision biases randomised too)."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(seed)
    model = vm.build(tiny_vl_config())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or (name.startswith("model.visual.") and ".norm" in name):
                p.normal_(1.0 if "visual" in name else 0.0, 0.2)
            elif name.startswith("model.visual.") and name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    vm.save_pretrained(model, path)
    return path


def hf_vision_lm(path: str):
    """transformers' eager Qwen3_5MoeForConditionalGeneration (fp32) holding the folder's weights."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    config._attn_implementation = "eager"
    hf = transformers.Qwen3_5MoeForConditionalGeneration(config).eval()
    hf.load_state_dict(vm.from_pretrained(path).state_dict(), strict=True)
    return hf


def make_vl_batch(grids: list, response_len: int, seed: int, hf=None, videos: list | None = None) -> TensorDict:
    """A verl rollout batch with images: per sample, `grids[i]` is a list of image grids [t, h, w]
    (empty: a text sample); the prompt is text, then per image `<start> placeholders <end>`, then text,
    then per video of `videos[i]` (grids [t, h, w]) each frame as `text text <start> placeholders <end>`;
    responses of 1..response_len text tokens. `multi_modal_inputs` per sample as verl's agent loop
    writes it (pixel_values, image_grid_thw, images_seqlens, and the video keys; {} for a text sample)
    and verl's 4-row position ids (text row, then transformers' `get_rope_index` of `hf`, on the valid
    tokens)."""
    import numpy as np

    gen = torch.Generator().manual_seed(seed)
    videos = videos or [[] for _ in grids]
    prompts, media = [], []
    for sample, clips in zip(grids, videos):
        ids = torch.randint(1, 80, (2,), generator=gen).tolist()
        pixels, video_pixels = [], []
        for t, h, w in sample:
            ids += (
                [VISION_START]
                + [IMAGE] * (t * h * w // 4)
                + [VISION_END]
                + torch.randint(1, 80, (2,), generator=gen).tolist()
            )
            pixels.append(torch.randn(t * h * w, PATCH_DIM, generator=gen))
        for t, h, w in clips:
            for _ in range(t):
                ids += torch.randint(1, 80, (2,), generator=gen).tolist() + [VISION_START] + [VIDEO] * (h * w // 4)
                ids += [VISION_END]
            video_pixels.append(torch.randn(t * h * w, PATCH_DIM, generator=gen))
        prompts.append(torch.tensor(ids))
        entry = {}
        if sample:
            grid = torch.tensor(sample)
            entry.update({"pixel_values": torch.cat(pixels), "image_grid_thw": grid,
                          "images_seqlens": torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0])})  # fmt: skip
        if clips:
            grid = torch.tensor(clips)
            entry.update({"pixel_values_videos": torch.cat(video_pixels), "video_grid_thw": grid,
                          "videos_seqlens": torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0])})  # fmt: skip
        media.append(entry)
    n, p = len(grids), max(x.numel() for x in prompts)
    prompt_rows = torch.zeros(n, p, dtype=torch.long)
    for i, x in enumerate(prompts):
        prompt_rows[i, p - x.numel() :] = x
    response_valid = torch.randint(1, response_len + 1, (n,), generator=gen)
    responses = torch.randint(1, 80, (n, response_len), generator=gen)
    batch = rollout_batch(prompt_rows, responses, torch.tensor([x.numel() for x in prompts]), response_valid)
    position_ids = torch.zeros(n, 4, batch["input_ids"].shape[1], dtype=torch.long)
    for i in range(n):
        valid = batch["attention_mask"][i].bool()
        ids = batch["input_ids"][i, valid][None]
        types = (ids == IMAGE).long() + 2 * (ids == VIDEO).long()
        rope, _ = hf.model.get_rope_index(ids, types, media[i].get("image_grid_thw"), media[i].get("video_grid_thw"))
        position_ids[i, 0, valid] = torch.arange(int(valid.sum()))
        position_ids[i, 1:, valid] = rope[:, 0]
    batch["position_ids"] = position_ids
    data = DataProto.from_single_dict(
        {
            "input_ids": batch["input_ids"],
            **batch,
            "advantages": torch.randn(n, 1, generator=gen).expand(-1, response_len) * batch["response_mask"],
        },
        meta_info={"temperature": 1.0},
    )
    data.non_tensor_batch["multi_modal_inputs"] = np.array(media, dtype=object)
    return left_right_2_no_padding(data.to_tensordict())


def hf_vl_log_probs(hf, data: TensorDict) -> torch.Tensor:
    """Per sample through transformers (its own position ids from the grids), full fp32 logits:
    nested log-prob [N, j] of each next token (a sequence's last entry is meaningless)."""
    out = []
    for i, ids in enumerate(data["input_ids"].unbind()):
        media = getattr(data["multi_modal_inputs"][i], "data", data["multi_modal_inputs"][i]) or {}
        ids = ids[None]
        logits = hf(
            input_ids=ids,
            pixel_values=media.get("pixel_values"),
            image_grid_thw=media.get("image_grid_thw"),
            pixel_values_videos=media.get("pixel_values_videos"),
            video_grid_thw=media.get("video_grid_thw"),
            mm_token_type_ids=(ids == IMAGE).long() + 2 * (ids == VIDEO).long(),
            use_cache=False,
        ).logits[0]
        labels = torch.cat([ids[0, 1:], ids[0, :1]])
        out.append(logprobs_from_logits_ref(logits.float(), labels, 1.0)[0])
    return torch.nested.nested_tensor_from_jagged(torch.cat(out), data["input_ids"].offsets())
