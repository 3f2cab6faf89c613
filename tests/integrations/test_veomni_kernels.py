"""VeOmni's own Qwen3.5-MoE with `verl_moe` in every slot we serve equals it with its eager slots.

Tolerances (fp32; Triton kernels under TRITON_INTERPRET on CPU, small shapes):
| output | bound |
|---|---|
| logits, loss, per-token log-probs and entropy | rel RMS 1e-5 against VeOmni's eager model in fp32 |
| every parameter gradient | rel RMS against the eager model in fp64 <= max(1e-4, 10 x the fp32 eager model's own) |
| A_log, dt_bias gradients | the same with 1e-3: sums over tokens that cancel (an element ~1e-6 of terms ~1e-4) |

VeOmni's eager GatedDeltaNet refuses packed sequences (no torch conv or chunk kernel takes cu_seqlens), so
its two GDN slots run transformers' torch chunk kernel and a depthwise F.conv1d one sequence at a time here.
That `import verl` registers the entries (our `verl.plugins` entry point) is checked in a fresh process.
"""

from __future__ import annotations

import ast
import copy
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_qwen3_5_moe_text
from verl_moe.ops import device
from verl_moe.ops.compare import rel_rms

pytest.importorskip("veomni", reason="VeOmni is not installed (pip install veomni==0.1.12 --no-deps)")
from veomni.arguments import OpsImplementationConfig  # noqa: E402
from veomni.models import build_foundation_model  # noqa: E402
from verl_moe.integrations import veomni as integration  # noqa: E402

# what `import verl` does through our plugin (checked in a fresh process below); explicit here so the model
# tests also run where verl is not installed (a GPU machine with torch, Triton, transformers and VeOmni)
integration.register()

TOL, GRAD_TOL = 1e-5, 1e-4
DECAY_GRAD_TOL = 1e-3
DECAY_PARAMS = ("A_log", "dt_bias")
FIELDS = integration.CONFIG_FIELDS
# VeOmni slots of Qwen3.5-MoE we have no kernel for (docs/integrations.md)
UNCOVERED = {("load_balancing_loss", "standard")}
LENGTHS = [5, 9]


def _ops(impl: str) -> OpsImplementationConfig:
    return OpsImplementationConfig(
        attn_implementation="sdpa",
        load_balancing_loss_implementation="eager",
        swiglu_mlp_implementation="eager",
        **dict.fromkeys(FIELDS, impl),
    )


def _bounds(cu: torch.Tensor) -> list[tuple[int, int]]:
    cu = cu.tolist()
    return list(zip(cu[:-1], cu[1:]))


def _conv_per_sequence(x, weight, bias=None, activation=None, seq_idx=None, backend=None, cu_seqlens=None):
    """Depthwise causal conv + SiLU with F.conv1d, one sequence at a time (x [1, T, C], weight [C, W])."""
    outs = []
    for s, e in _bounds(cu_seqlens):
        xs = F.pad(x[:, s:e].transpose(1, 2), (weight.shape[1] - 1, 0))
        outs.append(F.silu(F.conv1d(xs, weight[:, None], bias, groups=weight.shape[0])).transpose(1, 2))
    return torch.cat(outs, 1), None


def _gdn_per_sequence(q, k, v, g, beta, initial_state=None, output_final_state=False, **kwargs):
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe

    # transformers 5.17 wraps it to call fla where installed: the torch code itself
    torch_chunk_gated_delta_rule = inspect.unwrap(modeling_qwen3_5_moe.torch_chunk_gated_delta_rule)
    cu = kwargs.pop("cu_seqlens")
    outs = [
        torch_chunk_gated_delta_rule(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], **kwargs)[0]
        for s, e in _bounds(cu)
    ]
    return torch.cat(outs, 1), None


def _build(impl: str, state: dict, dtype=torch.float32, ops=None):
    model = build_foundation_model(
        tiny_qwen3_5_moe_text(),
        torch_dtype="float32",
        init_device=device.device_type(),
        ops_implementation=ops or _ops(impl),
    )
    model.load_state_dict(state, strict=True)
    if impl == "eager":
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.causal_conv1d_fn = _conv_per_sequence
                layer.linear_attn.chunk_gated_delta_rule = _gdn_per_sequence
    return model.to(dtype)


def _weights() -> dict:
    from transformers import Qwen3_5MoeForCausalLM

    torch.manual_seed(0)
    hf = Qwen3_5MoeForCausalLM(tiny_qwen3_5_moe_text())
    with torch.no_grad():
        for p in hf.parameters():  # norms start at 0 / 1: give every weight a part in the result
            p.add_(0.05 * torch.randn_like(p))
    return {k: v.to(device.current_device()) for k, v in hf.state_dict().items()}


def _batch():
    dev = device.current_device()
    T = sum(LENGTHS)
    ids = torch.randint(1, 128, (1, T), device=dev)
    pos = torch.cat([torch.arange(n, device=dev) for n in LENGTHS])[None]
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    packed = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(LENGTHS), max_length_k=max(LENGTHS))
    return ids, dict(position_ids=pos, use_cache=False, **packed)


def _run(model, ids, kw):
    """(logits of a label-free forward, loss, gradients, log-probs, entropy) of one model."""
    with torch.no_grad():
        logits = model(input_ids=ids, **kw).logits.float()
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, **kw).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    shift = torch.roll(ids, -1, dims=1)
    with torch.no_grad():
        aux = model(input_ids=ids, labels=ids, shift_labels=shift, return_log_probs=True, temperature=0.7, **kw)
    aux = aux.fused_linear_aux
    return logits, loss.detach().float(), grads, aux.log_probs.float(), aux.entropy.float()


def test_verl_moe_slots_equal_eager_slots(monkeypatch, restore_veomni_state):
    if not device.is_accelerator():
        monkeypatch.setenv("VERL_MOE_OPS", "triton")  # our Triton kernels, in the interpreter
    state = _weights()
    ids, kw = _batch()
    # slots are module-level: each model runs before the next one is built
    eager = _build("eager", state)
    eager64 = copy.deepcopy(eager).double()
    ref = _run(eager, ids, kw)
    ref64 = _run(eager64, ids, kw)
    del eager, eager64
    ours = _run(_build("verl_moe", state), ids, kw)
    for name, i in (("logits", 0), ("loss", 1), ("log_probs", 3), ("entropy", 4)):
        assert rel_rms(ref[i], ours[i]) <= TOL, name
    assert ours[2].keys() == ref[2].keys() == ref64[2].keys()
    for name, g in ours[2].items():
        floor = DECAY_GRAD_TOL if name.endswith(DECAY_PARAMS) else GRAD_TOL
        bound = max(floor, 10 * rel_rms(ref64[2][name], ref[2][name]))
        assert rel_rms(ref64[2][name], g) <= bound, name


def test_every_slot_resolves_to_our_kernel(monkeypatch, restore_veomni_state):
    """Fails if any slot we serve silently keeps VeOmni's kernel (or eager) when configured `verl_moe`."""
    from transformers.loss.loss_utils import LOSS_MAPPING
    from veomni.ops.kernels import moe

    if not device.is_accelerator():
        monkeypatch.setenv("VERL_MOE_OPS", "triton")
    model = _build("verl_moe", _weights())
    module = sys.modules[type(model).__module__]
    slots = {(v.op_name, v.variant): v for v in vars(module).values() if type(v).__name__ == "OpSlot"}
    assert set(slots) - set(integration.SLOTS) == UNCOVERED
    for key, slot in slots.items():
        if key in UNCOVERED:
            continue
        kernel = slot.bound_kernel()
        assert slot._impl_name == "verl_moe" and kernel is not None, key
        impl = kernel if isinstance(kernel, type) else kernel.verl_moe_impl
        assert impl.__module__.startswith("verl_moe."), (key, impl)
        # the Triton kernels, not our torch references
        assert ".reference" not in impl.__module__, (key, impl)
    for layer in model.model.layers:
        if hasattr(layer, "linear_attn"):
            attn = layer.linear_attn
            assert attn.causal_conv1d_fn.verl_moe_impl.__module__ == "verl_moe.ops.conv1d.conv"
            assert attn.chunk_gated_delta_rule.verl_moe_impl.__module__ == "verl_moe.ops.gdn.chunk"
            assert type(attn.norm).__module__ == "verl_moe.integrations.adapters"
    assert LOSS_MAPPING["ForCausalLM"].__name__ == "verl_moe_causal_lm_loss"
    assert moe._fused_moe_forward.verl_moe_impl.__module__.startswith("verl_moe.ops.experts")


REGISTRY_CHECK = """
import importlib, json
from veomni.ops.kernel_registry import KERNEL_REGISTRY
before = {key: dict(bucket) for key, bucket in KERNEL_REGISTRY._specs.items()}
importlib.import_module("verl")  # our verl.plugins entry point registers the entries
after = KERNEL_REGISTRY._specs
kept = all(after[key][name] is spec for key, bucket in before.items() for name, spec in bucket.items())
ours = sorted(f"{op}/{variant}" for (op, variant), bucket in after.items() if "verl_moe" in bucket)
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m
patched = m.Qwen3_5MoeExperts.forward.__module__.startswith("verl_moe.")
print(json.dumps({"kept": kept, "ours": ours, "transformers_patched": patched}))
"""


def test_import_verl_registers_without_replacing():
    """`import verl` alone: our VeOmni entries, none of VeOmni's replaced; with VERL_MOE_TRANSFORMERS_KERNELS=1
    also transformers' classes patched (verl's FSDP engine on transformers' model)."""
    if importlib.util.find_spec("verl") is None:
        pytest.skip("needs verl (our entry point is verl's plugin group)")
    env = {**os.environ, "VERL_MOE_TRANSFORMERS_KERNELS": "1"}
    out = subprocess.run([sys.executable, "-c", REGISTRY_CHECK], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["kept"], "a VeOmni kernel entry was replaced"
    assert result["ours"] == sorted(f"{op}/{variant}" for op, variant in integration.SLOTS)
    assert result["transformers_patched"]


def test_unchecked_version_or_slot_fails_in_one_line(monkeypatch):
    import veomni

    monkeypatch.setattr(veomni, "__version__", "9.9.9")
    with pytest.raises(RuntimeError, match=r"^VeOmni 9\.9\.9 is not a version") as info:
        integration.register()
    assert "\n" not in str(info.value)
    monkeypatch.undo()
    monkeypatch.setitem(integration.SLOTS, ("no_such_op", "standard"), (lambda: None, ""))
    with pytest.raises(RuntimeError, match=r"has no kernel slot no_such_op/standard$"):
        integration.register()


def _generated_sources() -> list[str]:
    names = [f"qwen3_5_moe.generated.patched_modeling_qwen3_5_moe_{d}" for d in ("gpu", "npu")]
    names += [f"qwen3_moe.generated.patched_modeling_qwen3_moe_{d}" for d in ("gpu", "npu")]
    names += [f"qwen3_5.generated.patched_modeling_qwen3_5_{d}" for d in ("gpu", "npu")]
    return [importlib.util.find_spec(integration.GENERATED_PREFIX + n).origin for n in names]


def test_every_call_site_fits_our_kernels():
    """VeOmni's Qwen3.5(-MoE) / Qwen3-MoE modeling files, GPU and NPU, call each slot in a way ours takes."""
    seen = set()
    for path in _generated_sources():
        tree = ast.parse(open(path).read())
        for (op, variant), (make, _) in integration.SLOTS.items():
            calls = integration.slot_calls(tree, op, variant)
            seen |= {(op, variant)} if calls else set()
            kernel = make()
            for call in calls:
                assert integration.call_fits(kernel, call) is None, (path, op, variant, ast.unparse(call))
    # the seq_cls head is not in these families
    assert seen == set(integration.SLOTS) - {("cross_entropy_loss", "seq_cls")}


def test_changed_call_site_is_found():
    source = textwrap.dedent(
        """
        veomni_rms_norm = OpSlot("rms_norm", "qwen3_5")
        veomni_conv = OpSlot("causal_conv1d", "standard")
        class Norm:
            def __init__(self):
                self.conv_fn = veomni_conv.bound_kernel()
            def forward(self, x):
                y = self.conv_fn(x=x, weight=self.w, kernel_size=4)
                return veomni_rms_norm(y, self.weight, self.eps, "extra")
        """
    )
    tree = ast.parse(source)
    (norm_call,) = integration.slot_calls(tree, "rms_norm", "qwen3_5")
    assert "too many positional" in integration.call_fits(integration.SLOTS[("rms_norm", "qwen3_5")][0](), norm_call)
    (conv_call,) = integration.slot_calls(tree, "causal_conv1d", "standard")
    why = integration.call_fits(integration.SLOTS[("causal_conv1d", "standard")][0](), conv_call)
    assert "kernel_size" in why


def test_other_names_still_reach_veomni():
    from transformers.loss.loss_utils import LOSS_MAPPING
    from veomni.ops.kernels import cross_entropy, moe

    saved = dict(LOSS_MAPPING)
    try:
        assert cross_entropy.install_loss_mapping("eager") == "CrossEntropy (eager)"
        assert LOSS_MAPPING["ForCausalLM"].keywords["cross_entropy_fn"].__module__.startswith("veomni.")
        with pytest.raises(ValueError, match="Unknown cross_entropy_loss_implementation"):
            cross_entropy.install_loss_mapping("no_such_kernel")
    finally:
        LOSS_MAPPING.clear()
        LOSS_MAPPING.update(saved)
    with pytest.raises(ValueError, match="Invalid fused_moe_kernel"):
        moe.apply_veomni_fused_moe_patch("no_such_kernel")


BF16_TOL = 2e-2  # two bf16 models (8 mantissa bits) of three layers


@pytest.mark.gpu
def test_verl_moe_slots_match_veomni_gpu_kernels(restore_veomni_state):
    """On a GPU, against VeOmni's default kernels (fla GDN / conv / gated norm, Liger RMSNorm and fused
    cross-entropy, its Triton group-GEMM MoE), in bf16 (its MoE kernel takes nothing else)."""
    for package in ("fla", "liger_kernel"):
        pytest.importorskip(package, reason=f"VeOmni's GPU defaults need {package} ('verl-moe[bench]')")
    from verl_moe.tools.bench.model import allow_fla_backward_on_hopper
    from verl_moe.tools.bench.veomni import _ops as bench_ops

    allow_fla_backward_on_hopper()  # `_run` backpropagates (the gradients are not compared here)
    state = _weights()
    ids, kw = _batch()
    theirs = _run(_build("veomni", state, torch.bfloat16, ops=bench_ops("veomni")), ids, kw)
    ours = _run(_build("verl_moe", state, torch.bfloat16, ops=bench_ops("verl_moe")), ids, kw)
    for name, i in (("logits", 0), ("loss", 1), ("log_probs", 3), ("entropy", 4)):
        assert rel_rms(theirs[i], ours[i]) <= BF16_TOL, name


@pytest.mark.usefixtures("needs_verl")
def test_verl_veomni_engine_config_selects_ours(monkeypatch, restore_veomni_state):
    """verl's own VeOmni engine turns `engine.<field>=verl_moe` into VeOmni's ops config: our kernels bind."""
    from verl.workers.config import VeOmniEngineConfig
    from verl.workers.engine.veomni.transformer_impl import _build_ops_implementation_config

    if not device.is_accelerator():
        monkeypatch.setenv("VERL_MOE_OPS", "triton")
    engine_config = VeOmniEngineConfig(attn_implementation="sdpa", **dict.fromkeys(FIELDS, "verl_moe"))
    model = _build("verl_moe", _weights(), ops=_build_ops_implementation_config(engine_config))
    module = sys.modules[type(model).__module__]
    bound = {(v.op_name, v.variant): v._impl_name for v in vars(module).values() if type(v).__name__ == "OpSlot"}
    assert {key: name for key, name in bound.items() if key not in UNCOVERED} == dict.fromkeys(
        set(bound) - UNCOVERED, "verl_moe"
    )


def test_log_prob_head_contract():
    """The `return_log_probs` path of our causal-LM head against a plain log-softmax: VeOmni's shift (the last
    position padded with 0), ignored labels give 0, a per-token temperature divides its own row."""
    head = integration.SLOTS[("cross_entropy_loss", "causal")][0]()
    T, D, VOCAB = 7, 16, 32
    hidden, weight = torch.randn(1, T, D, dtype=torch.float64), torch.randn(VOCAB, D, dtype=torch.float64)
    labels = torch.randint(0, VOCAB, (1, T))
    labels[0, 3] = -100
    temperature = torch.linspace(0.5, 1.5, T, dtype=torch.float64)[None]
    _, _, aux = head(
        hidden_states=hidden, weights=weight, labels=labels, return_log_probs=True, temperature=temperature
    )
    logits = (hidden[0, :-1] @ weight.T) / temperature[0, :-1, None]
    logp_all = torch.log_softmax(logits, -1)
    target = labels[0, 1:]
    keep = target != -100
    logp = torch.where(keep, logp_all.gather(-1, target.clamp_min(0)[:, None])[:, 0], 0.0)
    entropy = torch.where(keep, -(logp_all.exp() * logp_all).sum(-1), 0.0)
    assert aux.log_probs.shape == labels.shape and aux.log_probs[0, -1] == 0 and aux.entropy[0, -1] == 0
    assert rel_rms(logp, aux.log_probs[0, :-1]) <= 1e-6 and rel_rms(entropy, aux.entropy[0, :-1]) <= 1e-6


def test_gdn_slot_takes_veomni_host_offsets():
    """VeOmni's NPU modeling passes the offsets' host copy as cu_seqlens_list: the GDN slot hands it to
    the op as cu_seqlens_cpu (the same output as without it; a copy of the wrong length is refused,
    so it is not dropped)."""
    from verl_moe.integrations.adapters import make_chunk_gated_delta_rule

    gen = torch.Generator().manual_seed(0)
    T, H, HV, K, V = 9, 2, 4, 8, 8
    q, k = (torch.randn(1, T, H, K, generator=gen) for _ in range(2))
    v = torch.randn(1, T, HV, V, generator=gen)
    g, beta = -torch.rand(1, T, HV, generator=gen), torch.rand(1, T, HV, generator=gen)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    slot = make_chunk_gated_delta_rule()
    ref, _ = slot(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    out, _ = slot(q, k, v, g, beta, cu_seqlens=cu, cu_seqlens_list=[0, 4, 9], use_qk_l2norm_in_kernel=True)
    assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="host copy"):
        slot(q, k, v, g, beta, cu_seqlens=cu, cu_seqlens_list=[0, 9], use_qk_l2norm_in_kernel=True)
