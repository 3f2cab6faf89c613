"""The `reference` backend: the model spec eager in one process (fp64 unless the name says
otherwise); log-probs and entropy from full logits (`ops/logprob/reference.py`, not the fused op),
verl's `ppo_loss`, torch AdamW with verl's LR schedule. Also the θ0 `old_log_probs` of the stream (and,
for router replay R3, its θ0 `routed_experts`: the rollout's stand-in).

Router replay (`BackendSpec.replay`, the engines' `engines/router_replay.py` on the eager model): R2
records the model's own routes of every batch at θ0 (forward only, before step 1) and replays them in
every update; R3 replays the batch's `routed_experts`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from verl_moe.ops.logprob.reference import logprobs_and_entropy_ref

from ..data import to_verl
from ..job import Job, actor_config, lr_schedule, release_device_memory
from ..trace import BackendTrace, Probe, record_steps, response_values
from .engine import RouterRecorder
from .spec import DTYPES, BackendSpec


def unavailable(spec: BackendSpec) -> str | None:
    """The reference runs wherever torch does."""
    return None


def topk_sets(router_logits: tuple[torch.Tensor, ...], top_k: int) -> list[torch.Tensor]:
    return [logits.detach().topk(top_k, dim=-1).indices.sort(dim=-1).values.cpu() for logits in router_logits]


def full_logprobs(model, hidden: torch.Tensor, labels: torch.Tensor, temperature: float):
    """Full-logit log-prob and entropy per token ([T] each) of `model`'s lm_head, in the weight's
    dtype (fp32 at least)."""
    weight = model.lm_head.weight
    dtype = torch.promote_types(weight.dtype, torch.float32)
    return logprobs_and_entropy_ref(hidden, weight, labels, temperature, dtype=dtype)


def _forward(model, packed):
    """`model` over one packed row (`engines.batch.PackedBatch`), router logits kept; a vision-language
    batch's pixels and grids go to the tower."""
    offsets = {"cu_seqlens": packed.cu_seqlens, "cu_seqlens_cpu": packed.cu_seqlens_cpu}
    return model(packed.input_ids, packed.position_ids, output_router_logits=True, **offsets, **packed.media)


def _routed(model, replay, td, action: str, dev):
    """(model output, routes) of `model` over the packed batch `td` with `replay` armed for `action`:
    RECORD also returns the nested routed_experts [N, j, L, TOPK] of this forward; REPLAY replays td's
    (routes None)."""
    from verl_moe.engines.batch import pack_micro_batch
    from verl_moe.engines.router_replay import RECORD

    packed = pack_micro_batch(td, dev)
    with replay.armed(action, td, packed, None):
        out = _forward(model, packed)
        return out, replay.recorded(packed, None) if action == RECORD else None


def run_reference(job: Job, spec: BackendSpec, progress: Callable[[int], None] | None = None) -> BackendTrace:
    """The model spec eager in one process (fp64 unless the spec says otherwise)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss
    from verl_moe.engines.batch import pack_micro_batch
    from verl_moe.engines.router_replay import RECORD, REPLAY, RouterReplay
    from verl_moe.ops import device

    from verl_moe import models

    dev = device.current_device()
    torch.manual_seed(0)
    model = models.from_pretrained(job.model_dir, dtype=DTYPES[spec.compute_dtype], device=dev, ops=spec.ops_config())
    model.train()
    stream = job.stream()
    cfg = actor_config(job.train)
    params = dict(model.named_parameters())
    probe = Probe({n: p.numel() for n, p in params.items()}, budget=job.train.probe_budget)
    optimizer = torch.optim.AdamW(
        list(params.values()), lr=job.train.lr, betas=job.train.betas, eps=1e-8, weight_decay=job.train.weight_decay
    )
    scheduler = lr_schedule(job.train, optimizer)
    top_k = model.arch.num_experts_per_tok
    replay = RouterReplay(model) if spec.replay else None
    own_routes = []  # R2: this model's routes of each batch at θ0
    if spec.replay == "R2":
        with torch.no_grad():
            for batch in stream:
                td = to_verl(batch, job.train.temperature, global_batch_size=batch["input_ids"].shape[0]).to(dev)
                own_routes.append(_routed(model, replay, td, RECORD, dev)[1])
    # under replay the routers' output ids are the replayed ones (their logits' top-k are the free choice)
    recorder = None if replay is None else RouterRecorder(model)

    def train_step(k: int, batch: dict[str, torch.Tensor]) -> dict:
        td = to_verl(batch, job.train.temperature, global_batch_size=batch["input_ids"].shape[0]).to(dev)
        offsets = td["input_ids"].offsets()
        tokens = td["input_ids"].values()  # [T] packed; the model takes [1, T] plus cu_seqlens
        optimizer.zero_grad(set_to_none=True)
        if replay is None:
            out = _forward(model, pack_micro_batch(td, dev))
        else:
            if own_routes:
                td["routed_experts"] = own_routes[k]
            out, _ = _routed(model, replay, td, REPLAY, dev)
        labels = torch.roll(tokens, shifts=-1)
        logp, entropy = full_logprobs(model, out.last_hidden_state[0], labels, job.train.temperature)
        model_output = {
            "log_probs": torch.nested.nested_tensor_from_jagged(logp, offsets),
            "entropy": torch.nested.nested_tensor_from_jagged(entropy, offsets),
        }
        tu.assign_non_tensor(td, dp_size=1, batch_num_tokens=int(td["loss_mask"].sum().item()))
        loss, _ = ppo_loss(cfg, model_output, td)
        loss.backward()
        grads = probe.take({n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in params.items()})
        grad_norm = torch.nn.utils.clip_grad_norm_(list(params.values()), job.train.clip_grad).item()
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler.step()
        return dict(
            log_probs=response_values(logp, td),
            entropy=response_values(entropy, td),
            loss=loss.item(),
            grad_norm=grad_norm,
            grads=grads,
            topk=topk_sets(out.router_logits, top_k) if recorder is None else recorder.take(),
            lr=lr,
        )

    return record_steps(spec.label, spec.settings(1), stream, lambda: probe.take(params), train_step, progress)


@torch.no_grad()
def fill_old_log_probs(model_dir: str | Path, stream: list[dict], temperature: float, routes: bool = False) -> None:
    """Set each batch's `old_log_probs` [B, R] (fp32, 0 on padding) from the fp64 reference at θ0,
    as verl recomputes them with the actor before an update; with `routes`, also its θ0
    `routed_experts` [B, S, L, TOPK] int16 (0 on padding), as verl's agent loop lays out the
    rollout's routes for R3. Keys a batch already holds (a verl dump) are kept."""
    from verl.workers.utils.padding import no_padding_2_padding
    from verl_moe.engines.batch import pack_micro_batch
    from verl_moe.engines.router_replay import RECORD, RouterReplay
    from verl_moe.ops import device

    from verl_moe import models

    dev = device.current_device()
    ops = models.OpsConfig(router_dtype="fp64")  # the reference's own: an fp64 model routes in fp64
    model = models.from_pretrained(model_dir, dtype=torch.float64, device=dev, ops=ops)
    replay = RouterReplay(model) if routes else None
    for batch in stream:
        need_routes, need_logp = routes and "routed_experts" not in batch, "old_log_probs" not in batch
        if not (need_routes or need_logp):
            continue
        td = to_verl(batch, temperature, global_batch_size=batch["input_ids"].shape[0]).to(dev)
        if need_routes:  # one forward gives both: recording leaves the routing free
            out, recorded = _routed(model, replay, td, RECORD, dev)
            values = recorded.values().cpu()
            mask = batch["attention_mask"].bool()
            padded = torch.zeros(*mask.shape, *values.shape[1:], dtype=values.dtype)
            padded[mask] = values  # row-major over the valid tokens, as verl's unpad_input packs them
            batch["routed_experts"] = padded
        else:
            out = _forward(model, pack_micro_batch(td, dev))
        if not need_logp:
            continue
        logp, _ = full_logprobs(model, out.last_hidden_state[0], torch.roll(td["input_ids"].values(), -1), temperature)
        padded = no_padding_2_padding(logp, td).cpu() * batch["response_mask"]
        batch["old_log_probs"] = padded.to(torch.float32)
    del model
    release_device_memory()
