"""Which op moves the mid Qwen3.5-MoE preset away from fp64 on the GPU: the bf16 model on the default ops,
on all-torch ops, and with one op at a time switched to torch, each against the same weights in fp64
(hidden-state rel RMS after every layer, and mean |Δlogp| of the packed batch)."""

import sys

import torch
from verl_moe.models import OpsConfig, build
from verl_moe.ops.compare import rel_rms
from verl_moe.ops.logprob.reference import logprobs_from_logits_ref
from verl_moe.tools.align.data import get_preset, hf_config

preset = sys.argv[1] if len(sys.argv) > 1 else "mid-qwen3.5-moe"
cfg = hf_config(get_preset(preset))
torch.manual_seed(0)
ref = build(
    cfg,
    dtype=torch.float64,
    device="cuda",
    ops=OpsConfig(
        **dict.fromkeys(("gdn", "norm", "rope", "conv1d", "attention", "router", "experts", "logprob"), "torch"),
        router_dtype="fp64",
    ),
)
lengths = [300, 180, 420, 124]
cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
ids = torch.randint(0, cfg.vocab_size, (1, sum(lengths)), device="cuda")
pos = torch.cat([torch.arange(n) for n in lengths]).cuda()[None]
if getattr(ref.arch, "mrope_section", None):
    pos = pos.expand(3, 1, -1)


def trace(model):
    """Hidden state after every layer and the log-probs of the next token."""
    out = []
    hooks = [
        layer.register_forward_hook(lambda m, a, o: out.append((o[0] + o[1]).double())) for layer in model.model.layers
    ]
    with torch.no_grad():
        h = model(ids, pos, cu_seqlens=cu).last_hidden_state
        logits = model.logits(h).double()
    for hk in hooks:
        hk.remove()
    lp, _ = logprobs_from_logits_ref(logits[0, :-1], ids[0, 1:], calculate_entropy=False)
    return out, lp


want, want_lp = trace(ref)
state = ref.state_dict()
ops = ("gdn", "norm", "rope", "conv1d", "attention", "router", "experts", "logprob")
variants = {"default": OpsConfig(), "all torch": OpsConfig(**dict.fromkeys(ops, "torch"))}
variants.update({f"{op}=torch": OpsConfig(**{op: "torch"}) for op in ops})
for name, oc in variants.items():
    m = build(cfg, dtype=torch.bfloat16, device="cuda", ops=oc)
    m.load_state_dict(state)
    got, lp = trace(m)
    layers = " ".join(f"{rel_rms(w, g):.3g}" for w, g in zip(want, got))
    print(f"{name:16s} mean|dlogp| {(lp - want_lp).abs().mean().item():.3e}  layers rel-rms: {layers}", flush=True)
    del m
