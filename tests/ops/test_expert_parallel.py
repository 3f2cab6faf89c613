"""Expert-parallel routed experts on 2 gloo ranks vs the fp64 dense formula over the full weights.

Each rank routes its own tokens; rank r holds experts [r*E/2, (r+1)*E/2). The expert-weight
gradient of a rank must equal the sum over both ranks' tokens of the dense gradient, restricted
to its experts (the all-to-all backward brings every token's contribution to the expert's owner).
Every local experts implementation runs in the same two processes (the Triton one in the
interpreter), with the token moves that go with it.

Tolerances (rel RMS): fp32 vs fp64 out / grads 1e-5.
"""

import pytest
import torch
import torch.distributed as dist
from dist import spawn
from test_experts import TOPK, D, E, I, N, dense_formula
from verl_moe.models.process_groups import ExpertParallelGroup
from verl_moe.ops.compare import assert_rel_rms
from verl_moe.ops.dispatch import resolve
from verl_moe.ops.experts.expert_parallel import moe_experts_expert_parallel

pytestmark = pytest.mark.dist
ALL_IMPLS = ("torch", "grouped", "triton")


def _full_weights():
    g = torch.Generator().manual_seed(0)
    return torch.randn(E, 2 * I, D, generator=g) * 0.3, torch.randn(E, D, I, generator=g) * 0.3


def _rank_tokens(rank: int, routing: str):
    g = torch.Generator().manual_seed(100 + rank)
    n = 0 if routing == "first_half" and rank == 1 else N  # "first_half": rank 1 has no token either
    h = torch.randn(n, D, generator=g)
    if routing == "random":
        idx = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(N)])
    else:  # "first_half": every copy goes to rank 0's experts; rank 1 receives nothing
        rows = [torch.randperm(E // 2, generator=g)[:TOPK] for _ in range(n)]
        idx = torch.stack(rows) if rows else torch.zeros(0, TOPK, dtype=torch.long)
    w = torch.softmax(torch.randn(n, TOPK, generator=g), -1)
    dy = torch.randn(n, D, generator=g)
    return h, idx, w, dy


def _check_rank(rank: int, world_size: int, routing: str, impls: tuple[str, ...]) -> None:
    ep = ExpertParallelGroup(group=dist.group.WORLD, size=world_size, rank=rank)
    gate_up, down = _full_weights()
    h, idx, w, dy = _rank_tokens(rank, routing)
    local = slice(rank * E // world_size, (rank + 1) * E // world_size)

    ref_args = [t.double().requires_grad_() for t in (h, gate_up, down, w)]
    ref_out = dense_formula(ref_args[0], ref_args[1], ref_args[2], idx, ref_args[3])
    ref_grads = torch.autograd.grad((ref_out * dy.double()).sum(), ref_args)
    summed = [g.clone() for g in ref_grads[1:3]]  # expert grads summed over every rank's tokens
    for g in summed:
        dist.all_reduce(g)

    for impl in impls:
        experts = resolve("experts", impl)
        args = [h.clone(), gate_up[local].clone(), down[local].clone(), w.clone()]
        args = [t.requires_grad_() for t in args]
        out = moe_experts_expert_parallel(args[0], args[1], args[2], idx, args[3], ep, experts=experts)
        grads = torch.autograd.grad((out * dy).sum(), args)

        for name, ref, got in (
            ("out", ref_out, out),
            ("dhidden", ref_grads[0], grads[0]),
            ("dweight", ref_grads[3], grads[3]),
        ):
            if ref.numel():
                assert_rel_rms(f"{impl} {name}", ref, got, 1e-5)
            else:  # the rank without tokens
                assert got.shape == ref.shape, (impl, name)
        if routing == "first_half" and rank == 1:  # no token sent or received: zero expert gradients
            assert torch.count_nonzero(grads[1]) == 0 and torch.count_nonzero(grads[2]) == 0
        else:
            assert_rel_rms(f"{impl} dgate_up (local experts)", summed[0][local], grads[1], 1e-5)
            assert_rel_rms(f"{impl} ddown (local experts)", summed[1][local], grads[2], 1e-5)
        again = moe_experts_expert_parallel(h, gate_up[local], down[local], idx, w, ep, experts=experts)
        assert torch.equal(out.detach(), again), f"{impl}: not bitwise deterministic"


@pytest.mark.parametrize(
    "routing,impls", [("random", ("grouped", "triton")), ("first_half", ("triton",))], ids=["random", "first_half"]
)
def test_two_ranks_match_dense_fp64(routing, impls):
    spawn(_check_rank, 2, routing, impls)


@pytest.mark.slow
@pytest.mark.parametrize("routing", ["random", "first_half"])
def test_two_ranks_every_local_experts_impl(routing):
    spawn(_check_rank, 2, routing, ALL_IMPLS)


def _bad_ids(rank: int, world_size: int) -> None:
    ep = ExpertParallelGroup(group=dist.group.WORLD, size=world_size, rank=rank)
    gate_up, down = _full_weights()
    h, idx, w, _ = _rank_tokens(rank, "random")
    local = slice(rank * E // world_size, (rank + 1) * E // world_size)
    with pytest.raises(ValueError, match=rf"in \[0, E={E}\)"):
        moe_experts_expert_parallel(h, gate_up[local], down[local], idx.clone().fill_(E), w, ep)


def test_out_of_range_expert_ids_raise_before_communication():
    spawn(_bad_ids, 2)


def _grad_scale(rank: int, world_size: int) -> None:
    gate_up, down = _full_weights()
    h, idx, w, dy = _rank_tokens(rank, "random")
    local = slice(rank * E // world_size, (rank + 1) * E // world_size)
    grads = []
    for scale in (1.0, 0.5):
        ep = ExpertParallelGroup(group=dist.group.WORLD, size=world_size, rank=rank, weight_grad_scale=scale)
        args = [t.clone().requires_grad_() for t in (h, gate_up[local], down[local], w)]
        out = moe_experts_expert_parallel(args[0], args[1], args[2], idx, args[3], ep)
        grads.append(torch.autograd.grad((out * dy).sum(), args))
    (dh, dgu, ddn, dw), (dh_s, dgu_s, ddn_s, dw_s) = grads
    assert torch.equal(dh, dh_s) and torch.equal(dw, dw_s)  # only the expert weights' gradients scale
    assert torch.equal(dgu * 0.5, dgu_s) and torch.equal(ddn * 0.5, ddn_s)


def test_weight_grad_scale_scales_only_the_expert_weight_gradients():
    spawn(_grad_scale, 2)
