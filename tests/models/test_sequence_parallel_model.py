"""Ulysses sequence parallelism inside the model: `MoeCausalLM.set_sequence_parallel` on 2 gloo
ranks against the plain forward of the same weights on the whole packed row. Isolates the model's
exchanges (attention, GatedDeltaNet heads and conv channels) from the engine.

Run in fp64 (router included) so that anything beyond rounding is a bug: hidden states max abs
1e-10, parameter gradients (summed over ranks) rel RMS 1e-10. (In fp32 the largest differences are
rounding of small gradients such as dt_bias, rel RMS ~3e-5; the engine test covers fp32.)
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import verl_moe.models as vm
from dist import spawn
from tiny_models import randomize_norms, tiny_qwen3_5_moe_text, tiny_qwen3_moe
from verl_moe.engines.batch import PackedBatch, slice_packed
from verl_moe.models.process_groups import UlyssesGroup
from verl_moe.ops.compare import assert_rel_rms

# unequal, one of length 1, an odd total (so the last rank's share ends in one pad token)
LENGTHS = [6, 1, 9, 3]
DTYPE = torch.float64

CONFIGS = {
    # GatedDeltaNet: 2 key heads, 4 value heads -> 1 and 2 per rank; attention 4 q / 2 kv heads
    "qwen3_5_moe": tiny_qwen3_5_moe_text,
    # one kv head for 2 ranks: each rank gets a replicated copy
    "qwen3_moe_kv1": lambda: tiny_qwen3_moe(num_key_value_heads=1),
}


def _packed_row(seed: int) -> PackedBatch:
    gen = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)
    ids = torch.randint(1, 128, (1, total), generator=gen)
    offsets = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    return PackedBatch(
        input_ids=ids,
        position_ids=torch.cat([torch.arange(n) for n in LENGTHS])[None],
        cu_seqlens=offsets.to(torch.int32),
        labels=torch.roll(ids[0], -1),
        inv_temperature=torch.ones(total),
        offsets=offsets,
    )


def _sp_forward_matches_plain(rank: int, world_size: int) -> None:
    sp = UlyssesGroup(group=dist.group.WORLD, size=world_size, rank=rank)
    for name, make_config in CONFIGS.items():
        torch.manual_seed(0)
        model = vm.build(make_config(), dtype=DTYPE, ops=vm.OpsConfig(router_dtype="model"))
        randomize_norms(model)
        packed = _packed_row(seed=1)
        T = packed.num_tokens
        weight = torch.randn(1, T, model.arch.hidden_size, generator=torch.Generator().manual_seed(2), dtype=DTYPE)

        hidden = model(packed.input_ids, packed.position_ids, packed.cu_seqlens).last_hidden_state
        (hidden * weight).sum().backward()
        # lm_head is not part of the hidden states: no gradient in either run
        reference_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)

        model.set_sequence_parallel(sp)
        local, pad = slice_packed(packed, sp)
        t = local.num_tokens
        local_hidden = model(local.input_ids, local.position_ids, local.cu_seqlens).last_hidden_state
        real = slice(rank * t, min((rank + 1) * t, T))  # this rank's tokens that are not padding
        n_real = real.stop - real.start
        diff = (local_hidden[:, :n_real] - hidden.detach()[:, real]).abs().max().item()
        assert diff <= 1e-10, (name, diff)
        # the pad token(s) get no weight: the loss is the plain run's, split over ranks
        local_weight = torch.nn.functional.pad(weight, (0, 0, 0, pad))[:, rank * t : (rank + 1) * t]
        (local_hidden * local_weight).sum().backward()
        assert {n for n, p in model.named_parameters() if p.grad is not None} == set(reference_grads), name
        for param_name, p in model.named_parameters():
            if p.grad is None:
                continue
            grad = p.grad.clone()
            dist.all_reduce(grad)
            assert_rel_rms(f"{name} grad {param_name}", reference_grads[param_name], grad, 1e-10)
        model.set_sequence_parallel(None)
        assert all(getattr(m, "sequence_parallel", None) is None for m in model.modules())


@pytest.mark.dist
def test_sequence_parallel_forward_and_grads_match_plain_forward():
    spawn(_sp_forward_matches_plain, 2)


def test_sequence_parallel_rejects_indivisible_heads():
    model = vm.build(tiny_qwen3_5_moe_text(), device="meta")
    # 4 attention heads, 2 kv heads, 2 GatedDeltaNet key heads, 4 value heads
    with pytest.raises(ValueError, match="linear_num_key_heads"):
        model.set_sequence_parallel(UlyssesGroup(group=None, size=4, rank=0))
    with pytest.raises(ValueError, match="num_attention_heads"):
        model.set_sequence_parallel(UlyssesGroup(group=None, size=3, rank=0))
    assert model.sequence_parallel is None
