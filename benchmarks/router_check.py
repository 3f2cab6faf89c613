"""Router gradients on the GPU: ours (triton) and the fp32 torch reference, each against fp64 (Qwen3.5 router)."""

import torch
from verl_moe.ops.compare import rel_rms
from verl_moe.ops.router.reference import route_ref
from verl_moe.ops.router.topk import route_triton

torch.manual_seed(0)
h = torch.randn(16384, 2048, device="cuda").bfloat16()
w = (torch.randn(256, 2048, device="cuda") * 0.02).bfloat16()
dw, dl = torch.randn(16384, 8, device="cuda"), torch.randn(16384, 256, device="cuda")
print("tf32 allowed:", torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())


def grads(fn, dtype):
    a = [t.to(dtype).requires_grad_() if dtype == torch.float64 else t.clone().requires_grad_() for t in (h, w)]
    logits, tw, _ = fn(*a, 8, True, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    return torch.autograd.grad((tw * dw.to(tw.dtype)).sum() + (logits * dl.to(logits.dtype)).sum(), a)


g64 = grads(route_ref, torch.float64)
for name, fn in (("triton", route_triton), ("torch fp32", route_ref)):
    g = grads(fn, torch.bfloat16)
    print(name, "d_hidden", rel_rms(g64[0], g[0]), "d_gate", rel_rms(g64[1], g[1]))
