"""Where bf16 error grows in the mid Qwen3.5-MoE preset, layer by layer, on CPU: the bf16 model (torch ops)
vs the same weights in fp64, rel-RMS of each mixer's and MoE block's input and output, the router logits
and the layer output (first LAYERS layers; the first-layer MoE turns a 0.7% input error into 4.5%).

    .venv/bin/python scripts/diag_q35_layers.py [LAYERS]   # ~1 min for 4 layers on 2 cores
"""

import sys

import torch
from verl_moe.models import OpsConfig, build
from verl_moe.ops.compare import rel_rms
from verl_moe.tools.align.data import get_preset, hf_config

LAYERS = int(sys.argv[1]) if len(sys.argv) > 1 else 4
cfg = hf_config(get_preset("mid-qwen3.5-moe"))
cfg.num_hidden_layers = LAYERS
cfg.layer_types = cfg.layer_types[:LAYERS]
torch.manual_seed(0)
ref = build(cfg, dtype=torch.float64, ops=OpsConfig(router_dtype="fp64"))
lengths = [200, 120]
cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
ids = torch.randint(0, cfg.vocab_size, (1, sum(lengths)))
pos = torch.cat([torch.arange(n) for n in lengths])[None].expand(3, 1, -1)


def trace(model) -> dict[str, torch.Tensor]:
    seen: dict[str, torch.Tensor] = {}

    def keep(name, tensor):
        seen[name] = tensor.detach().double()

    def on(module, **names):  # names: label -> picks the tensor from (inputs, output); the hook returns None
        def hook(m, args, out):
            for label, pick in names.items():
                keep(label, pick(args, out))

        hooks.append(module.register_forward_hook(hook))

    hooks = []
    for i, layer in enumerate(model.model.layers):
        mixer = layer.linear_attn if hasattr(layer, "linear_attn") else layer.self_attn
        on(mixer, **{f"L{i} mixer in": lambda a, o: a[0], f"L{i} mixer": lambda a, o: o})
        on(
            layer.mlp,
            **{
                f"L{i} moe in": lambda a, o: a[0],
                f"L{i} moe": lambda a, o: o[0],
                f"L{i} router logits": lambda a, o: o[1],
            },
        )
        on(layer, **{f"L{i} out": lambda a, o: o[0] + o[1]})
    with torch.no_grad():
        model(ids, pos, cu_seqlens=cu)
    for h in hooks:
        h.remove()
    return seen


want = trace(ref)
bf16 = build(cfg, dtype=torch.bfloat16)
bf16.load_state_dict(ref.state_dict())
got = trace(bf16)
for name, w in want.items():
    print(f"{name:18s} rel-rms {rel_rms(w, got[name]):.3g}   rms {w.pow(2).mean().sqrt().item():.3g}")
