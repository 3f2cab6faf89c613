"""The `megatron` backend of `verl-moe align`: megatron-core's `GPTModel` with HF weights.

What runs (under torchrun, `launch.py`'s worker -> `run_megatron_rank`; data parallel over
the ranks, world 1 on one GPU):

- Model: `GPTModel` built from megatron-core's *local* layer specs (`get_gpt_decoder_block_spec`
  with `use_transformer_engine=False`: no TransformerEngine), configured from the Qwen3-MoE HF
  config: RMSNorm, q/k RMSNorm, GQA with `kv_channels = head_dim`, RoPE with the config's base,
  SwiGLU experts (`SequentialMLP`), top-k router with softmax scores, no biases, untied output
  layer, no token dropping (capacity None), the `alltoall` token dispatcher (megatron's default).
  Qwen3's `norm_topk_prob=True` (softmax over all experts, renormalised over the top-k) equals
  megatron's `moe_router_pre_softmax=False` (top-k of the logits, softmax over those k): softmax is
  monotone, so the same experts win, and the renormalised weights are the same softmax.
- Router: `moe_router_dtype` from the backend's `router=` option: fp32 (default) -> "fp32",
  fp64 -> "fp64", bf16 -> None (the model dtype; only in a bf16 model). Our engines add no
  load-balancing loss to the policy loss, so megatron runs with `moe_router_load_balancing_type=
  "none"` and `moe_aux_loss_coeff=0`: the same loss on both sides.
- Precision (bf16, the default): megatron's own mixed-precision stack, as megatron trainers run
  it: bf16 parameters in `Float16Module`, megatron `DistributedDataParallel` with fp32 gradient
  buffers (`main_grad`), and `get_megatron_optimizer` (bf16 -> `Float16OptimizerWithFloat16Params`
  with fp32 master weights, grad-norm and clipping on the fp32 grads, Adam with decoupled weight
  decay, i.e. AdamW; TransformerEngine/apex absent -> torch's AdamW underneath). The fp32 master
  weights are set from the HF fp32 weights after the optimizer is built (megatron would copy them
  from the bf16 model, rounding θ0), so every backend starts from the same θ0. Weight decay
  applies to every parameter (megatron by default skips biases and 1-D params; our engines and
  verl's FSDP optimizer do not). LR: megatron's `OptimizerParamScheduler`, constant with linear
  warmup from 0, the schedule verl's `get_constant_schedule_with_warmup` gives.
  `dtype=fp32`: fp32 parameters, megatron's `FP32Optimizer`.
- Batches: the local attention (`DotProductAttention`) takes no packed (THD) input, so each verl
  batch runs as right-padded rows [B, S] with positions 0..L-1 and an explicit causal mask; values
  are read on real tokens only. Padding cannot change a real token: it sits after every real token
  of its row (causal), and routing without capacity is per token.
- Log-probs and entropy: from the full logits `GPTModel` returns (bf16 output layer; fp32 after
  `Float16Module`), log-softmax in fp32, labels as in the reference; verl's `ppo_loss` with the
  same `actor_config` as every backend.
- Probes: megatron parameters, fp32 gradients (`main_grad`) and fp32 master weights are mapped back
  to the HF names of our model spec (`megatron_names.megatron_to_hf`), so the `Probe` reads the same coordinates.
  (Our spec gives the embedding row of a configured `pad_token_id` no gradient, megatron does; the
  two differ only when that id occurs in a batch. The Qwen3-MoE presets configure none.)

Where it cannot run (reported by `megatron_unavailable`): without megatron-core; without a CUDA
GPU (GPTModel's forward calls CUDA-only code: `torch.cuda.current_device()` in the rotary
embedding, the model-parallel CUDA RNG tracker in attention, `torch.cuda.Stream` in the alltoall
dispatcher); megatron-core < 0.17 without TransformerEngine (its MoE router gating reads an
undefined `te_general_gemm`). Qwen3.5-MoE (GatedDeltaNet + gated attention, (1 + w) norms,
shared expert) builds from a local composition in `megatron_qwen35.py`; its GDN kernels come from
fla (on a GPU; megatron refuses to build GatedDeltaNet without fla). Where fla refuses its backward
(Hopper with Triton < 3.7.1, a known miscompile) the layers run megatron's own torch chunked kernel.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from verl_moe.ops.logprob.reference import logprobs_from_logits_ref

from ..data import rank_batch
from ..job import Job, actor_config
from ..trace import BackendTrace, Probe, gather_step_outputs, record_steps, response_values
from . import megatron_qwen35 as qwen35
from .megatron_names import check_supported, hf_to_megatron, megatron_to_hf
from .spec import BackendSpec

PAD_TOKEN = 0  # what padded positions hold; their outputs are never read
MEGATRON_ROUTER_DTYPES = {"fp32": "fp32", "fp64": "fp64", "bf16": None}  # None: the model dtype


# ---- what can run ------------------------------------------------------------------------------


def _router_gating_broken() -> str | None:
    """megatron-core < 0.17 imports `te_general_gemm` only with TransformerEngine, yet its router
    gating reads it unconditionally: every MoE forward raises NameError without TE."""
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return None
    import megatron.core

    return (
        f"megatron-core {megatron.core.__version__} without TransformerEngine cannot route MoE tokens "
        "(router gating reads the undefined te_general_gemm; fixed in 0.17); install megatron-core>=0.17 "
        "(Python >= 3.12) or TransformerEngine"
    )


def megatron_unavailable(spec: BackendSpec) -> str | None:
    """Why the megatron backend `spec` cannot run on this machine, or None when it can."""
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        return "megatron-core is not installed (pip install 'verl-moe[megatron]')"
    if not torch.cuda.is_available():
        return (
            "megatron-core's GPTModel needs a CUDA GPU: its forward calls torch.cuda.current_device() "
            "(rotary embedding), the model-parallel CUDA RNG tracker (attention dropout) and torch.cuda.Stream "
            "(alltoall MoE dispatcher); no CUDA device here"
        )
    broken = _router_gating_broken()
    if broken:
        return broken
    if spec.compute_dtype not in ("bf16", "fp32"):
        return f"{spec.label}: megatron trains in bf16 (fp32 master weights) or fp32, not {spec.compute_dtype}"
    if spec.router_dtype == "bf16" and spec.compute_dtype != "bf16":
        return f"{spec.label}: megatron's router runs in the model dtype, fp32 or fp64; a bf16 router needs dtype=bf16"
    return None


# ---- building the model ------------------------------------------------------------------------


def transformer_config(
    arch, dtype: str, router: str, use_cpu_initialization: bool = False, token_dispatcher: str = "alltoall"
):
    """megatron's TransformerConfig for a Qwen3-MoE `ArchConfig`.

    dtype: "bf16" | "fp32" (parameters and compute). router: a key of MEGATRON_ROUTER_DTYPES.
    token_dispatcher: megatron's MoE token dispatcher; "alltoall" (its default) or "allgather"
    (the same routing and combine; it builds no CUDA stream, so it also constructs on CPU)."""
    from megatron.core.transformer import TransformerConfig

    check_supported(arch)
    bf16 = dtype == "bf16"
    moe = any(t == "moe" for t in arch.mlp_types)
    return TransformerConfig(
        num_layers=len(arch.layer_types),
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_key_value_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.intermediate_size or arch.moe_intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        num_moe_experts=arch.num_experts if moe else None,
        moe_layer_freq=[1 if t == "moe" else 0 for t in arch.mlp_types],
        moe_ffn_hidden_size=arch.moe_intermediate_size if moe else None,
        moe_router_topk=arch.num_experts_per_tok,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not arch.norm_topk_prob,
        moe_router_dtype=MEGATRON_ROUTER_DTYPES[router],
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_expert_capacity_factor=None,
        moe_token_dispatcher_type=token_dispatcher,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_cpu_initialization=use_cpu_initialization,
        perform_initialization=False,  # every weight comes from the HF checkpoint
        # the fused paths below need apex / TE / CUDA extensions that the local spec does without
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        **qwen35.config_kwargs(arch),
    )


def build_gpt_model(config, arch):
    """An uninitialised `GPTModel` on the local (no-TE) layer specs for `config` / `arch`."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    if "linear_attention" in arch.layer_types:
        spec = qwen35.decoder_block_spec(config, arch)
    else:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    rotary_base = int(arch.rope_theta) if float(arch.rope_theta).is_integer() else arch.rope_theta
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=arch.vocab_size,
        max_sequence_length=4096,  # used by learned position embeddings only; RoPE sizes itself per batch
        position_embedding_type="rope",
        rotary_percent=arch.partial_rotary_factor,
        rotary_base=rotary_base,
        share_embeddings_and_output_weights=False,
    )


def load_hf_weights(gpt, hf: dict[str, torch.Tensor], arch) -> None:
    """Copy our spec's HF-named weights into `gpt` (cast to its dtype), strictly."""
    converted = hf_to_megatron(hf, arch)
    own = {k: v for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}
    missing, unexpected = sorted(set(own) - set(converted)), sorted(set(converted) - set(own))
    if missing or unexpected:
        raise ValueError(f"HF -> megatron mapping does not match GPTModel: missing {missing}, unexpected {unexpected}")
    for name, tensor in converted.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise ValueError(f"{name}: converted shape {tuple(tensor.shape)} != GPTModel {tuple(own[name].shape)}")
    gpt.load_state_dict(converted, strict=False)


# ---- batches -----------------------------------------------------------------------------------


def padded_rows(td) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """verl's no-padding batch -> (input_ids [B, S] right-padded with PAD_TOKEN, position_ids [B, S]
    (0..S-1 per row), real [B, S] bool). Real tokens in row-major order are the packed tokens."""
    ids = td["input_ids"]
    lengths = ids.offsets().diff()
    # built by hand: to_padded_tensor pads to the nested tensor's cached max length, which verl's
    # no-padding batches set to the whole packed length (rows as wide as the batch's tokens)
    positions = torch.arange(int(lengths.max()), device=ids.values().device)
    real = positions[None, :] < lengths[:, None]
    rows = torch.full(real.shape, PAD_TOKEN, dtype=ids.dtype, device=real.device)
    rows[real] = ids.values()
    return rows, positions.expand_as(rows).contiguous(), real


def causal_mask(seq_len: int, device) -> torch.Tensor:
    """[1, 1, S, S] bool, True where attention is masked (megatron's convention)."""
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(1)[None, None]


class MegatronRoutingRecorder:
    """Forward hooks on megatron's `TopKRouter`s: each router's routing map ([S*B, E] bool, tokens
    in megatron's sequence-major order) of the last forward, in layer order."""

    def __init__(self, module: torch.nn.Module, top_k: int):
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers = [m for m in module.modules() if isinstance(m, TopKRouter)]
        self.top_k = top_k
        self.maps: dict[int, torch.Tensor] = {}
        for r in self.routers:
            r.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        _, routing_map = output
        self.maps[id(module)] = routing_map.detach()

    def take(self, real: torch.Tensor) -> list[torch.Tensor]:
        """Per MoE layer the sorted top-k expert ids [T, TOPK] of the real tokens of `real` [B, S],
        in packed (row-major) order."""
        rows, cols = real.shape
        out = []
        for r in self.routers:
            routing_map = self.maps.pop(id(r)).reshape(cols, rows, -1).transpose(0, 1)[real]  # [T, E]
            ids = routing_map.float().topk(self.top_k, dim=-1).indices  # exactly TOPK experts are set
            out.append(ids.sort(dim=-1).values.cpu())
        return out


def _main_params(optimizer) -> dict[int, torch.Tensor]:
    """id(model parameter) -> the fp32 tensor megatron's optimizer updates (its master copy)."""
    out = {}
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(opt, "fp32_from_float16_groups"):  # Float16OptimizerWithFloat16Params
            for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups):
                out.update({id(p): main for p, main in zip(model_group, main_group)})
            for group in opt.fp32_from_fp32_groups:
                out.update({id(p): p for p in group})
        else:  # FP32Optimizer: the model parameters themselves
            for group in opt.param_groups:
                out.update({id(p): p for p in group["params"]})
    return out


# ---- the run -----------------------------------------------------------------------------------


@dataclass
class MegatronModel:
    """A GPTModel with HF weights, wrapped as megatron trains it.

    gpt: the bare GPTModel (parameter names of `hf_to_megatron`); model: what to call and step,
    DistributedDataParallel(Float16Module(gpt)) in bf16 or DistributedDataParallel(gpt) in fp32;
    hf_weights: the checkpoint's fp32 weights under our spec's names (θ0 of the master copies)."""

    arch: object
    config: object
    gpt: torch.nn.Module
    model: torch.nn.Module
    hf_weights: dict[str, torch.Tensor]
    recorder: MegatronRoutingRecorder

    def named_main_grads(self) -> dict[str, torch.Tensor]:
        """The fp32 gradient buffers megatron's DDP accumulated, under our spec's names."""
        return megatron_to_hf({n: p.main_grad.detach() for n, p in self.gpt.named_parameters()}, self.arch)


def build_megatron(
    model_dir: str, dtype: str, router: str, dev: torch.device, token_dispatcher: str = "alltoall"
) -> MegatronModel:
    """Build and wrap the GPTModel of the HF folder `model_dir` (megatron's parallel state must be
    initialised). dtype: "bf16" | "fp32"; router: a key of MEGATRON_ROUTER_DTYPES."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    from verl_moe import models

    if dtype not in ("bf16", "fp32"):
        raise ValueError(f"megatron trains in bf16 or fp32, not {dtype}")
    hf_model = models.from_pretrained(model_dir, dtype=torch.float32, device="cpu")
    if hasattr(hf_model.model, "visual"):
        raise ValueError(f"{model_dir}: the megatron backend builds text models only (this one has a vision tower)")
    arch, hf_weights = hf_model.arch, hf_model.state_dict()
    del hf_model
    config = transformer_config(arch, dtype, router, dev.type == "cpu", token_dispatcher)
    gpt = build_gpt_model(config, arch)
    refused = qwen35.fla_backward_refused() if dev.type == "cuda" else None
    if refused and "linear_attention" in arch.layer_types:
        n = qwen35.use_megatron_torch_gdn(gpt)
        print(f"megatron: {refused}: {n} GatedDeltaNet layers run megatron's torch_chunk_gated_delta_rule", flush=True)
    load_hf_weights(gpt, hf_weights, arch)
    gpt.to(dev)
    wrapped = Float16Module(config, gpt) if dtype == "bf16" else gpt
    model = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False), wrapped
    )
    return MegatronModel(arch, config, gpt, model, hf_weights, MegatronRoutingRecorder(gpt, arch.num_experts_per_tok))


def forward_backward(mm: MegatronModel, td, temperature: float, loss_config, dp_size: int = 1) -> dict:
    """One forward + backward of this rank's verl batch `td` (on the model's device); the
    data-parallel mean of the gradients lands in the fp32 `main_grad` buffers of every rank.
    Returns log_probs / entropy ([T] fp32, packed order), the loss tensor and topk (per MoE layer
    [T, TOPK]) of this rank's tokens."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    rows, positions, real = padded_rows(td)
    tokens, offsets = td["input_ids"].values(), td["input_ids"].offsets()
    mm.model.train()
    mm.model.zero_grad_buffer()
    logits = mm.model(rows, positions, causal_mask(rows.shape[1], rows.device))  # [B, S, VOCAB]
    logp, entropy = logprobs_from_logits_ref(logits[real].float(), torch.roll(tokens, shifts=-1), temperature)
    del logits
    model_output = {
        "log_probs": torch.nested.nested_tensor_from_jagged(logp, offsets),
        "entropy": torch.nested.nested_tensor_from_jagged(entropy, offsets),
    }
    num_tokens = td["loss_mask"].sum().to(torch.float64)
    if dp_size > 1:  # verl normalises by the tokens of the whole batch, over every rank
        torch.distributed.all_reduce(num_tokens)
    tu.assign_non_tensor(td, dp_size=dp_size, batch_num_tokens=int(num_tokens.item()))
    loss, _ = ppo_loss(loss_config, model_output, td)
    loss.backward()
    mm.model.finish_grad_sync()
    return {"log_probs": logp.detach(), "entropy": entropy.detach(), "loss": loss, "topk": mm.recorder.take(real)}


def megatron_optimizer(mm: MegatronModel, train, total_steps: int):
    """megatron's optimizer (fp32 masters set to the HF weights) and LR scheduler for `train`."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=train.lr,
            min_lr=train.lr,
            weight_decay=train.weight_decay,
            adam_beta1=train.betas[0],
            adam_beta2=train.betas[1],
            adam_eps=1e-8,
            clip_grad=train.clip_grad,
            bf16=mm.config.bf16,
            params_dtype=mm.config.params_dtype,
            use_distributed_optimizer=False,
        ),
        [mm.model],
        config_overrides={},  # {} (not None): weight decay on every parameter, as the other backends
    )
    main = _main_params(optimizer)
    hf_masters = hf_to_megatron(mm.hf_weights, mm.arch)
    with torch.no_grad():  # exact fp32 θ0 in the master copies (megatron copied them from bf16)
        for name, p in mm.gpt.named_parameters():
            main[id(p)].copy_(hf_masters[name])
    decay_steps = max(total_steps, train.warmup_steps + 1)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=train.lr,
        min_lr=train.lr,
        lr_warmup_steps=train.warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style="constant",
        start_wd=train.weight_decay,
        end_wd=train.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def train_megatron(job: Job, spec: BackendSpec, progress: Callable[[int], None] | None = None) -> BackendTrace | None:
    """K optimizer steps of megatron's GPTModel on the job's stream, data-parallel over the ranks
    (megatron's parallel state and RNG tracker initialised; tensor/pipeline/expert sizes 1). Each
    batch's rows split in contiguous blocks over the ranks, as verl dispatches. Returns the trace
    on rank 0, None elsewhere."""
    import torch.distributed as dist
    from verl_moe.ops import device

    rank, world = dist.get_rank(), dist.get_world_size()
    train, dev = job.train, device.current_device()
    mm = build_megatron(job.model_dir, spec.compute_dtype, spec.router_dtype, dev)
    stream = job.stream()
    optimizer, scheduler = megatron_optimizer(mm, train, len(stream))
    main = _main_params(optimizer)
    named = dict(mm.gpt.named_parameters())

    def masters() -> dict[str, torch.Tensor]:
        return megatron_to_hf({n: main[id(p)].detach() for n, p in named.items()}, mm.arch)

    probe = Probe({n: t.numel() for n, t in masters().items()}, budget=train.probe_budget)
    loss_config = actor_config(train)

    def train_step(k: int, batch: dict[str, torch.Tensor]) -> dict:
        td = rank_batch(batch, k, rank, world, train.temperature).to(dev)
        optimizer.zero_grad()
        out = forward_backward(mm, td, train.temperature, loss_config, dp_size=world)
        grads = probe.take(mm.named_main_grads())  # already reduced over the ranks
        lr = optimizer.param_groups[0]["lr"]
        updated, grad_norm, _ = optimizer.step()
        if not updated:
            raise RuntimeError(f"step {k}: megatron's optimizer skipped the update (non-finite gradients)")
        scheduler.step(increment=1)
        loss, log_probs, entropy, topk = gather_step_outputs(
            out["loss"].item(),
            response_values(out["log_probs"], td),
            response_values(out["entropy"], td),
            out["topk"],
            world,
            dev,
        )
        return dict(
            log_probs=log_probs, entropy=entropy, loss=loss, grad_norm=float(grad_norm), grads=grads, topk=topk, lr=lr
        )

    def probe_masters() -> dict[str, torch.Tensor] | None:
        return probe.take(masters()) if rank == 0 else None  # data parallel: every rank holds the same

    return record_steps(spec.label, spec.settings(world), stream, probe_masters, train_step, progress, rank)


def run_megatron_rank(job: Job, spec: BackendSpec, progress: Callable[[int], None]) -> BackendTrace | None:
    """One torchrun rank of the megatron backend: process group, megatron's parallel state (data
    parallel over every rank) and CUDA RNG tracker, then `train_megatron`. Trace on rank 0."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    from verl_moe.ops import device

    dist.init_process_group(backend=device.dist_backend())
    device.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    try:
        return train_megatron(job, spec, progress)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
