"""HF <-> megatron-core parameter names and layouts for the `megatron` backend of `verl-moe align`.

`hf_to_megatron` turns our spec's (transformers') parameters into a megatron `GPTModel` state dict
(local layer specs: `megatron.py`; Qwen3.5's local composition: `megatron_qwen35.py`);
`megatron_to_hf` maps parameters, gradients or master weights back, so the align probes read the
same coordinates on every backend. Both read one list of (HF name, megatron name) pairs for what
moves by name alone; the fused tensors are exact row moves:

- attention: megatron's `linear_qkv` holds, per KV group, its query heads, then the key head, then
  the value head (`fuse_qkv`).
- experts: `linear_fc1` of expert e is our `gate_up_proj[e]` (gate rows first: megatron's SwiGLU
  takes the first half as the gate), `linear_fc2` is `down_proj[e]`.

Qwen3.5-MoE adds:
- GDN `in_proj` = [in_proj_qkv (q | k | v, head-major); in_proj_z; in_proj_b; in_proj_a] rows;
  conv1d, A_log, dt_bias, norm (-> out_norm), out_proj by name.
- gated attention: HF q_proj rows are per head [query K rows; gate K rows]; megatron's
  `linear_qkv` with `attention_output_gate` is per KV group [its queries; their gates; key; value].
- shared expert: linear_fc1 = [gate_proj; up_proj], linear_fc2 = down_proj, gate_weight =
  shared_expert_gate.weight ([1, D], sigmoid-gated as HF).
"""

from __future__ import annotations

import torch

GDN_HF = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")  # GDN in_proj's row blocks, in order


def check_supported(arch) -> None:
    """Raise ValueError for what this converter does not map onto megatron's local GPT specs."""
    problems = []
    hybrid = "linear_attention" in arch.layer_types  # the features below come with megatron_qwen35
    if not hybrid and (arch.attn_output_gate or arch.norm_unit_offset or arch.shared_expert_intermediate_size):
        problems.append("Qwen3.5 features (gated attention, (1 + w) norms, shared expert) without GatedDeltaNet")
    if arch.attention_bias:
        problems.append("attention biases")
    if arch.tie_word_embeddings:
        problems.append("tied embeddings")
    if arch.mrope_section is not None and not hybrid:
        problems.append("mRoPE")
    if problems:
        raise ValueError("the megatron backend cannot build this model: " + "; ".join(problems))


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """HF q/k/v projections -> megatron's fused `linear_qkv` rows.

    q: [H*K, D], k and v: [HKV*K, D] (head-major rows). Returns [HKV*(H/HKV + 2)*K, D]: for each KV
    group g in order, the K rows of each of its H/HKV query heads, then key head g, then value head g
    (megatron splits `linear_qkv`'s output per query group in this order)."""
    d = q.shape[-1]
    per_group = [t.reshape(num_kv_heads, -1, d) for t in (q, k, v)]  # [HKV, rows of the group, D]
    return torch.cat(per_group, dim=1).reshape(-1, d)


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    """Inverse of `fuse_qkv`: [HKV*(H/HKV + 2)*K, D] -> (q [H*K, D], k [HKV*K, D], v [HKV*K, D])."""
    d = qkv.shape[-1]
    q_rows = num_heads // num_kv_heads * head_dim
    grouped = qkv.reshape(num_kv_heads, q_rows + 2 * head_dim, d)
    q, k, v = grouped.split([q_rows, head_dim, head_dim], dim=1)
    return q.reshape(-1, d), k.reshape(-1, d), v.reshape(-1, d)


def _layer_names(i: int) -> tuple[str, str]:
    return f"model.layers.{i}.", f"decoder.layers.{i}."


def _renamed(arch) -> list[tuple[str, str]]:
    """(our name, megatron name) of every parameter that converts by its name alone; both directions
    of the conversion read this one list."""
    pairs = [
        ("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
        ("model.norm.weight", "decoder.final_layernorm.weight"),
        ("lm_head.weight", "output_layer.weight"),
    ]
    for i in range(len(arch.layer_types)):
        h, m = _layer_names(i)
        pairs += [
            (h + "input_layernorm.weight", m + "input_layernorm.weight"),
            (h + "post_attention_layernorm.weight", m + "pre_mlp_layernorm.weight"),
        ]
        if arch.layer_types[i] != "linear_attention":
            pairs += [
                (h + "self_attn.o_proj.weight", m + "self_attention.linear_proj.weight"),
                (h + "self_attn.q_norm.weight", m + "self_attention.q_layernorm.weight"),
                (h + "self_attn.k_norm.weight", m + "self_attention.k_layernorm.weight"),
            ]
        pairs += qwen35_renamed(arch, i, h, m)
        if arch.mlp_types[i] == "moe":
            pairs.append((h + "mlp.gate.weight", m + "mlp.router.weight"))
        else:
            pairs.append((h + "mlp.down_proj.weight", m + "mlp.linear_fc2.weight"))
    return pairs


def hf_to_megatron(hf: dict[str, torch.Tensor], arch) -> dict[str, torch.Tensor]:
    """Our spec's (transformers') parameters -> megatron `GPTModel` (local spec) state dict.

    Experts come fused as in our spec (`mlp.experts.gate_up_proj` [E, 2I, D], gate rows first;
    `mlp.experts.down_proj` [E, D, I]); megatron's `linear_fc1` of expert e is gate_up_proj[e]
    (megatron's SwiGLU takes the first half of fc1's output as the gate)."""
    check_supported(arch)
    out = {theirs: hf[ours] for ours, theirs in _renamed(arch)}
    for i in range(len(arch.layer_types)):
        h, m = _layer_names(i)
        attn = h + "self_attn."
        qwen35_to_megatron(hf, arch, i, h, m, out)  # GDN in_proj, gated qkv, shared expert
        if arch.layer_types[i] != "linear_attention" and not arch.attn_output_gate:
            out[m + "self_attention.linear_qkv.weight"] = fuse_qkv(
                hf[attn + "q_proj.weight"],
                hf[attn + "k_proj.weight"],
                hf[attn + "v_proj.weight"],
                arch.num_key_value_heads,
            )
        if arch.mlp_types[i] == "moe":
            gate_up, down = hf[h + "mlp.experts.gate_up_proj"], hf[h + "mlp.experts.down_proj"]
            for e in range(arch.num_experts):
                expert = f"{m}mlp.experts.local_experts.{e}."
                out[expert + "linear_fc1.weight"] = gate_up[e]
                out[expert + "linear_fc2.weight"] = down[e]
        else:
            out[m + "mlp.linear_fc1.weight"] = torch.cat([hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]])
    return out


def megatron_to_hf(mc: dict[str, torch.Tensor], arch) -> dict[str, torch.Tensor]:
    """Inverse of `hf_to_megatron` (for parameters, gradients or master weights): megatron names
    -> our spec's names, experts stacked back into [E, 2I, D] / [E, D, I]."""
    check_supported(arch)
    out = {ours: mc[theirs] for ours, theirs in _renamed(arch)}
    for i in range(len(arch.layer_types)):
        h, m = _layer_names(i)
        attn = h + "self_attn."
        qwen35_to_hf(mc, arch, i, h, m, out)
        if arch.layer_types[i] != "linear_attention" and not arch.attn_output_gate:
            qkv = mc[m + "self_attention.linear_qkv.weight"]
            q, k, v = split_qkv(qkv, arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim)
            out[attn + "q_proj.weight"], out[attn + "k_proj.weight"], out[attn + "v_proj.weight"] = q, k, v
        if arch.mlp_types[i] == "moe":
            experts = [f"{m}mlp.experts.local_experts.{e}." for e in range(arch.num_experts)]
            out[h + "mlp.experts.gate_up_proj"] = torch.stack([mc[x + "linear_fc1.weight"] for x in experts])
            out[h + "mlp.experts.down_proj"] = torch.stack([mc[x + "linear_fc2.weight"] for x in experts])
        else:
            gate, up = mc[m + "mlp.linear_fc1.weight"].chunk(2)
            out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
    return out


# ---- Qwen3.5-MoE's parts -----------------------------------------------------------------------


def fuse_gated_qkv(q_gate: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_kv_heads: int):
    """HF gated q_proj [H*2K, D] (per head: query rows, gate rows) with k, v [HKV*K, D] ->
    megatron's gated `linear_qkv` [HKV*(2H/HKV + 2)*K, D]: per KV group its queries, their gates,
    the key head, the value head."""
    d = q_gate.shape[-1]
    q, gate = q_gate.reshape(num_heads, 2, -1, d).unbind(1)  # [H, K, D] each
    per_group = [t.reshape(num_kv_heads, -1, d) for t in (q, gate, k, v)]
    return torch.cat(per_group, dim=1).reshape(-1, d)


def split_gated_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    """Inverse of `fuse_gated_qkv` -> (q_proj [H*2K, D], k [HKV*K, D], v [HKV*K, D])."""
    d = qkv.shape[-1]
    q_rows = num_heads // num_kv_heads * head_dim
    grouped = qkv.reshape(num_kv_heads, 2 * q_rows + 2 * head_dim, d)
    q, gate, k, v = grouped.split([q_rows, q_rows, head_dim, head_dim], dim=1)
    q_gate = torch.stack([q.reshape(num_heads, head_dim, d), gate.reshape(num_heads, head_dim, d)], dim=1)
    return q_gate.reshape(-1, d), k.reshape(-1, d), v.reshape(-1, d)


def qwen35_renamed(arch, i: int, h: str, m: str) -> list[tuple[str, str]]:
    """(HF name, megatron name) of layer i's Qwen3.5 parameters that move by name."""
    pairs = []
    if arch.layer_types[i] == "linear_attention":
        a, b = h + "linear_attn.", m + "self_attention."
        pairs += [(a + n, b + n) for n in ("conv1d.weight", "A_log", "dt_bias", "out_proj.weight")]
        pairs.append((a + "norm.weight", b + "out_norm.weight"))
    if arch.mlp_types[i] == "moe" and arch.shared_expert_intermediate_size:
        pairs += [
            (h + "mlp.shared_expert.down_proj.weight", m + "mlp.shared_experts.linear_fc2.weight"),
            (h + "mlp.shared_expert_gate.weight", m + "mlp.shared_experts.gate_weight"),
        ]
    return pairs


def qwen35_to_megatron(hf: dict, arch, i: int, h: str, m: str, out: dict) -> None:
    """Layer i's fused Qwen3.5 tensors, HF -> megatron, into `out`."""
    if arch.layer_types[i] == "linear_attention":
        out[m + "self_attention.in_proj.weight"] = torch.cat([hf[f"{h}linear_attn.{n}.weight"] for n in GDN_HF])
    elif arch.attn_output_gate:
        attn = h + "self_attn."
        out[m + "self_attention.linear_qkv.weight"] = fuse_gated_qkv(
            hf[attn + "q_proj.weight"],
            hf[attn + "k_proj.weight"],
            hf[attn + "v_proj.weight"],
            arch.num_attention_heads,
            arch.num_key_value_heads,
        )
    if arch.mlp_types[i] == "moe" and arch.shared_expert_intermediate_size:
        se = h + "mlp.shared_expert."
        out[m + "mlp.shared_experts.linear_fc1.weight"] = torch.cat(
            [hf[se + "gate_proj.weight"], hf[se + "up_proj.weight"]]
        )


def qwen35_to_hf(mc: dict, arch, i: int, h: str, m: str, out: dict) -> None:
    """Inverse of `qwen35_to_megatron` for layer i."""
    if arch.layer_types[i] == "linear_attention":
        qk = arch.linear_num_key_heads * arch.linear_key_head_dim
        v = arch.linear_num_value_heads * arch.linear_value_head_dim
        nv = arch.linear_num_value_heads
        parts = mc[m + "self_attention.in_proj.weight"].split([2 * qk + v, v, nv, nv])
        out.update({f"{h}linear_attn.{n}.weight": t for n, t in zip(GDN_HF, parts)})
    elif arch.attn_output_gate:
        attn = h + "self_attn."
        q, k, v = split_gated_qkv(
            mc[m + "self_attention.linear_qkv.weight"],
            arch.num_attention_heads,
            arch.num_key_value_heads,
            arch.head_dim,
        )
        out[attn + "q_proj.weight"], out[attn + "k_proj.weight"], out[attn + "v_proj.weight"] = q, k, v
    if arch.mlp_types[i] == "moe" and arch.shared_expert_intermediate_size:
        gate, up = mc[m + "mlp.shared_experts.linear_fc1.weight"].chunk(2)
        se = h + "mlp.shared_expert."
        out[se + "gate_proj.weight"], out[se + "up_proj.weight"] = gate, up
