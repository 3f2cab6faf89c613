"""Data-parallel ranks that would run different numbers of micro-batches (FSDP collectives once
per forward: the rank with fewer forwards leaves the other waiting forever) all raise one clear
ValueError within seconds, and stay in step: a valid batch trains right after, on both ranks.

Cases on 2 gloo ranks: by count, 4 and 2 sequences with micro_batch_size_per_gpu=2 (2 and 1
micro-batches); by count, a rank whose batch is smaller than the micro-batch size; dynamic, a
token budget that needs more micro-batches than the other rank has sequences.
"""

from __future__ import annotations

import pytest
import torch
from engine_setup import build_engine, grpo_actor_config, make_batch, ppo_loss_fn, write_tiny_model
from verl.utils import tensordict_utils as tu

# name: (sequences on rank 0, on rank 1, batch switches, what the error says)
CASES = {
    "count_4_vs_2": (4, 2, dict(use_dynamic_bsz=False, micro_batch_size_per_gpu=2), "hold 1 to 2 micro-batches"),
    "count_batch_below_size": (4, 1, dict(use_dynamic_bsz=False, micro_batch_size_per_gpu=2), "larger than the batch"),
    "dynamic_4_vs_1": (4, 1, dict(use_dynamic_bsz=True, max_token_len_per_gpu=12), "holds only 1 sequences"),
}


def _batch(sequences: int, seed: int, **switches):
    """`sequences` GRPO samples of 5 + 6 tokens (fixed lengths, so token budgets are exact)."""
    data = make_batch(sequences, 5, 6, seed=seed, valid=([5] * sequences, [6] * sequences))
    gen = torch.Generator().manual_seed(seed)
    data["old_log_probs"] = -4.5 + 0.3 * torch.randn(data["responses"].shape, generator=gen)
    data["ref_log_prob"] = -4.5 + 0.3 * torch.randn(data["responses"].shape, generator=gen)
    tu.assign_non_tensor(data, global_batch_size=2 * sequences, **switches)
    return data


def uneven_batches(rank: int, world_size: int, path: str) -> dict:
    """Each case must raise on this rank; returns {case: message} and the valid step's grad norm."""
    engine = build_engine(path)
    loss_fn = ppo_loss_fn(grpo_actor_config())
    messages = {}
    for name, (first, second, switches, _) in CASES.items():
        data = _batch(first if rank == 0 else second, seed=rank, **switches)
        with pytest.raises(ValueError) as raised, engine.train_mode():
            engine.train_batch(data, loss_fn)
        messages[name] = str(raised.value)
    data = _batch(2, seed=rank, use_dynamic_bsz=False, micro_batch_size_per_gpu=2)
    with engine.train_mode():
        out = engine.train_batch(data, loss_fn)
    return {"messages": messages, "grad_norm": out["metrics"]["grad_norm"]}


@pytest.mark.dist
def test_uneven_micro_batch_counts_raise_on_every_rank(tmp_path):
    from forked import shared_server

    path = write_tiny_model(str(tmp_path / "model"))
    outcome = shared_server().run(__name__, "uneven_batches", 2, path, timeout=60)
    assert not outcome.timed_out, "a rank hung: the ranks ran different numbers of micro-batches"
    results = outcome.check()
    for name, (*_, expected) in CASES.items():
        for rank, result in enumerate(results):
            message = result["messages"][name]
            assert expected in message and "\n" not in message, (name, rank, message)
    # both ranks took the same optimizer step afterwards (FSDP reduces the gradients: one norm)
    assert results[0]["grad_norm"] == results[1]["grad_norm"]
