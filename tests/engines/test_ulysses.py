"""Ulysses primitives on 2 gloo ranks against a single-process run: packed-row slicing, the
all-to-all pair around causal attention (forward and input gradients, GQA and kv heads fewer
than ranks), and the token gather's gradient. Tolerance: fp32 max abs 1e-6."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist import spawn
from engine_setup import make_batch
from verl_moe.engines import batch
from verl_moe.engines.batch import slice_packed
from verl_moe.models.process_groups import UlyssesGroup
from verl_moe.ops.attention import causal_attention_ref


def _ulysses_matches_single_process(rank: int, world_size: int) -> None:
    sp = UlyssesGroup(group=dist.group.WORLD, size=world_size, rank=rank)

    packed = batch.pack_micro_batch(make_batch(3, 4, 4, seed=7), torch.device("cpu"))
    local, pad = slice_packed(packed, sp)
    assert pad == -packed.num_tokens % world_size and local.cu_seqlens[-1] == packed.num_tokens + pad
    assert torch.equal(sp.gather_tokens(local.input_ids[0], pad), packed.input_ids[0])
    assert torch.equal(sp.gather_tokens(local.labels, pad), packed.labels)

    cu = local.cu_seqlens
    T = int(cu[-1])
    for kv_heads in (2, 1):
        gen = torch.Generator().manual_seed(kv_heads)
        q = torch.randn(1, T, 4, 8, generator=gen, requires_grad=True)
        k = torch.randn(1, T, kv_heads, 8, generator=gen, requires_grad=True)
        v = torch.randn(1, T, kv_heads, 8, generator=gen, requires_grad=True)
        w = torch.randn(1, T, 4, 8, generator=gen)
        reference = causal_attention_ref(q, k, v, cu_seqlens=cu)
        (reference * w).sum().backward()

        tokens = slice(rank * T // world_size, (rank + 1) * T // world_size)
        lq, lk, lv = (t.detach()[:, tokens].clone().requires_grad_() for t in (q, k, v))
        heads_q = sp.seq_to_heads(lq)
        heads_k, heads_v = sp.seq_to_heads(sp.expand_kv_heads(lk)), sp.seq_to_heads(sp.expand_kv_heads(lv))
        out = sp.heads_to_seq(causal_attention_ref(heads_q, heads_k, heads_v, cu_seqlens=cu))
        assert (out - reference.detach()[:, tokens]).abs().max() <= 1e-6
        (out * w[:, tokens]).sum().backward()
        for name, got, full in (("q", lq, q), ("k", lk, k), ("v", lv, v)):
            assert (got.grad - full.grad[:, tokens]).abs().max() <= 1e-6, (kv_heads, name)

    with pytest.raises(ValueError, match="do not split"):
        sp.head_slice(3)
    assert sp.head_slice(4) == slice(2 * rank, 2 * rank + 2)

    # every rank computes the same loss on the gathered tokens: the gradient of a rank's slice is
    # the sum over ranks, i.e. size x its own (FSDP's average over dp x sp ranks undoes the factor)
    x = (torch.arange(4.0) + rank).requires_grad_()
    w = torch.arange(4.0 * world_size)
    (sp.gather_tokens(x, 0) * w).sum().backward()
    assert torch.equal(x.grad, world_size * w[rank * 4 : (rank + 1) * 4])


@pytest.mark.dist
def test_ulysses_primitives_match_single_process():
    spawn(_ulysses_matches_single_process, 2)
