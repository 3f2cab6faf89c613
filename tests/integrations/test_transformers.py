"""transformers' Qwen3.5-MoE / Qwen3-MoE with our kernels swapped in equals them unpatched, and revert gives
back transformers' outputs bit for bit.

Tolerances (fp32; Triton kernels under TRITON_INTERPRET on CPU, small shapes):
| output | bound |
|---|---|
| logits | rel RMS 1e-5 against the unpatched model in fp32 |
| every parameter gradient | rel RMS against the unpatched model in fp64 <= max(1e-4, 10 x the fp32 model's own) |
| A_log, dt_bias gradients | the same with 1e-3: sums over tokens that cancel (an element ~1e-6 of terms ~1e-4) |
| after revert | logits and gradients bitwise equal to the unpatched run |

Unpatched, transformers' Qwen3.5 GatedDeltaNet runs its torch code (`use_torch_gdn`, also where fla is
installed), an independent reference for our GDN and conv kernels. Two unpadded sequences side by side (batch 2).
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_qwen3_5_moe_text, tiny_qwen3_moe
from transformers import Qwen3_5MoeForCausalLM, Qwen3MoeForCausalLM
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
from transformers.models.qwen3_moe import modeling_qwen3_moe
from verl_moe.integrations import transformers as patch
from verl_moe.ops import device
from verl_moe.ops.compare import rel_rms

TOL, GRAD_TOL = 1e-5, 1e-4
DECAY_GRAD_TOL = 1e-3
DECAY_PARAMS = ("A_log", "dt_bias")
B, T = 2, 10

FAMILIES = {
    "qwen3.5-moe": (
        tiny_qwen3_5_moe_text,
        Qwen3_5MoeForCausalLM,
        modeling_qwen3_5_moe,
        patch.apply_to_qwen3_5_moe,
        patch.revert_qwen3_5_moe,
    ),
    "qwen3-moe": (
        tiny_qwen3_moe,
        Qwen3MoeForCausalLM,
        modeling_qwen3_moe,
        patch.apply_to_qwen3_moe,
        patch.revert_qwen3_moe,
    ),
}


@pytest.fixture(autouse=True)
def _our_triton_kernels(monkeypatch):
    if not device.is_accelerator():
        monkeypatch.setenv("VERL_MOE_OPS", "triton")  # our Triton kernels, in the interpreter


def _model(family: str, torch_gdn: bool = True):
    """The family's tiny model, same weights on every call; GatedDeltaNet on transformers' torch code unless
    torch_gdn is False (where fla is installed transformers would call it, in fp64 too)."""
    make_config, cls, *_ = FAMILIES[family]
    config = make_config()
    config._experts_implementation = "eager"  # transformers' grouped_mm path has no fp64
    torch.manual_seed(0)
    model = cls(config)
    with torch.no_grad():
        for p in model.parameters():  # norms start at 0 / 1: give every weight a part in the result
            p.add_(0.05 * torch.randn_like(p))
    if torch_gdn and family == "qwen3.5-moe":
        patch.use_torch_gdn(model)
    return model.to(device.current_device())


def _run(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    loss.backward()
    return logits.detach().float(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_matches(ref, ref64, out):
    assert rel_rms(ref[0], out[0]) <= TOL
    assert out[1].keys() == ref[1].keys()
    for name, g in out[1].items():
        floor = DECAY_GRAD_TOL if name.endswith(DECAY_PARAMS) else GRAD_TOL
        bound = max(floor, 10 * rel_rms(ref64[1][name], ref[1][name]))
        assert rel_rms(ref64[1][name], g) <= bound, name


def _assert_ours_inside(family: str, model, instance: bool) -> None:
    """Every swapped piece of `model` runs our Triton kernels (fails if one silently kept transformers')."""
    _, _, mod, _, _ = FAMILIES[family]
    layers = model.model.layers
    if family == "qwen3.5-moe":
        gdn = next(layer.linear_attn for layer in layers if hasattr(layer, "linear_attn"))
        if patch.gdn_kernels_at_construction(mod):  # transformers 5.10: instance attributes
            conv, rule = gdn.causal_conv1d_fn, gdn.chunk_gated_delta_rule
        elif instance:  # 5.17, one model: its forward swaps the module functions in
            swapped = vars(gdn)["forward"].__func__.swapped
            conv, rule = swapped["causal_conv1d_fn"], swapped["torch_chunk_gated_delta_rule"]
        else:  # 5.17, the module
            conv, rule = mod.causal_conv1d_fn, mod.torch_chunk_gated_delta_rule
        assert rule.verl_moe_impl.__module__ == "verl_moe.ops.gdn.chunk"
        assert conv.verl_moe_impl.__module__ == "verl_moe.ops.conv1d.conv"
        assert gdn.norm.forward.__func__.verl_moe_impl.__module__ == "verl_moe.ops.norm.fused"
    experts = layers[0].mlp.experts
    assert experts.forward.__func__.verl_moe_impl.__module__.startswith("verl_moe.ops.experts")
    assert layers[0].mlp.gate.forward.__func__.verl_moe_impl.__module__ == "verl_moe.ops.router.topk"
    attention = next(layer.self_attn for layer in layers if hasattr(layer, "self_attn"))
    rope = vars(attention)["forward"].__func__.swapped["apply_rotary_pos_emb"] if instance else mod.apply_rotary_pos_emb
    assert rope.verl_moe_impl.__module__ == "verl_moe.ops.rope.fused"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_instance_patch_equals_unpatched_and_reverts_bitwise(family):
    _, _, mod, apply, revert = FAMILIES[family]
    model = _model(family)
    ids = torch.randint(1, 128, (B, T), device=device.current_device())
    ref = _run(model, ids)
    ref64 = _run(_model(family).double(), ids)
    other, rope = _model(family), mod.apply_rotary_pos_emb
    apply(model)
    _assert_ours_inside(family, model, instance=True)
    _assert_matches(ref, ref64, _run(model, ids))
    # one instance only: another model and the module keep transformers' code
    assert "forward" not in vars(other.model.layers[0].mlp.experts)
    assert mod.apply_rotary_pos_emb is rope
    revert(model)
    back = _run(model, ids)
    assert torch.equal(back[0], ref[0])
    assert all(torch.equal(back[1][n], ref[1][n]) for n in ref[1])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_class_patch_equals_unpatched_and_reverts(family):
    _, cls, mod, apply, revert = FAMILIES[family]
    before = dict(vars(mod))
    ids = torch.randint(1, 128, (B, T), device=device.current_device())
    ref = _run(_model(family), ids)
    ref64 = _run(_model(family).double(), ids)
    apply()
    try:
        model = _model(family, torch_gdn=False)  # built after apply: the same weights (same seed), our kernels
        _assert_ours_inside(family, model, instance=False)
        _assert_matches(ref, ref64, _run(model, ids))
    finally:
        revert()
    assert all(vars(mod)[name] is value for name, value in before.items())
    back = _run(_model(family), ids)
    assert torch.equal(back[0], ref[0])


def _loss_run(model, ids, **kwargs):
    """(loss, gradients, the output) of the model's own loss with labels."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, **kwargs)
    out.loss.backward()
    return (
        out.loss.detach().float(),
        {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        out,
    )


@pytest.mark.parametrize("family", list(FAMILIES))
def test_loss_with_labels_equals_unpatched_without_logits(family):
    """With labels (some ignored), num_items_in_batch and the router's aux loss, the patched forward's loss and
    gradients match transformers' loss (the module docstring's bounds), with no [tokens, vocab] logits formed;
    shift_labels in place of labels gives the same loss; without labels transformers' forward runs as it is;
    revert gives back transformers' loss bitwise."""
    _, _, _, apply, revert = FAMILIES[family]
    ids = torch.randint(1, 128, (B, T), device=device.current_device())
    labels = ids.clone()
    labels[0, :3] = -100
    kwargs = dict(labels=labels, output_router_logits=True, num_items_in_batch=torch.tensor(13))
    ref = _loss_run(_model(family), ids, **kwargs)
    ref64 = _loss_run(_model(family).double(), ids, **kwargs)
    assert ref[2].aux_loss is not None and ref[2].logits.shape == (B, T, ref[2].logits.shape[-1])
    model = _model(family)
    apply(model)
    out = _loss_run(model, ids, **kwargs)
    _assert_matches(ref[:2], ref64[:2], out[:2])
    assert out[2].logits.shape[:2] == (B, 0)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    again = model(input_ids=ids, shift_labels=shifted, output_router_logits=True, num_items_in_batch=torch.tensor(13))
    assert torch.equal(again.loss, out[0])
    assert model(input_ids=ids).logits.shape[1] == T  # no labels: transformers' forward
    revert(model)
    back = _loss_run(model, ids, **kwargs)
    assert torch.equal(back[0], ref[0])


def test_patching_another_family_fails():
    model = _model("qwen3.5-moe")
    with pytest.raises(ValueError, match="has no modeling_qwen3_moe modules"):
        patch.apply_to_qwen3_moe(model)
    assert "forward" not in vars(model.model.layers[0].mlp.experts)


def test_swapping_forward_holds_the_swap_for_its_own_call_only():
    """The mechanism behind a per-instance rope (and transformers 5.17's GDN functions)."""
    import types

    mod = types.ModuleType("fake_modeling")
    mod.kernel = lambda x: x + 1

    class Layer(torch.nn.Module):
        def forward(self, x):
            if x is None:
                raise RuntimeError("boom")
            return mod.kernel(x)

    ours, other = Layer(), Layer()
    ours.forward = types.MethodType(patch.swapping_forward(mod, {"kernel": lambda x: x * 10}), ours)
    assert ours(2) == 20 and other(2) == 3 and mod.kernel(2) == 3
    with pytest.raises(RuntimeError, match="boom"):
        ours(None)
    assert mod.kernel(2) == 3
