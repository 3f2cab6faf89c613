"""engines/batch.py on verl-format batches: packing, unpacking, micro-batching, output order, switches.

Expected values are built independently, one sequence at a time from the padded batch."""

from __future__ import annotations

import pytest
import torch
from engine_setup import make_batch
from verl.utils import tensordict_utils as tu
from verl_moe.engines import batch


def _padded_sequences(batch_size, prompt_len, response_len, seed):
    """The same batch as make_batch, as per-sequence (ids, positions) lists from the padded form."""
    data = make_batch(batch_size, prompt_len, response_len, seed)
    return data, list(data["input_ids"].unbind()), list(data["position_ids"].unbind())


def test_pack_matches_per_sequence_concatenation():
    data, ids, positions = _padded_sequences(5, 6, 4, seed=0)
    temperature = torch.tensor([0.5, 1.0, 1.5, 2.0, 0.7])
    data["temperature"] = temperature
    packed = batch.pack_micro_batch(data, torch.device("cpu"))
    flat = torch.cat(ids)
    assert torch.equal(packed.input_ids, flat[None])
    assert torch.equal(packed.position_ids, torch.cat(positions)[None])
    assert packed.position_ids.is_contiguous() and packed.input_ids.is_contiguous()
    lens = torch.tensor([len(t) for t in ids])
    assert packed.cu_seqlens.dtype == torch.int32
    assert packed.cu_seqlens.tolist() == [0, *torch.cumsum(lens, 0).tolist()]
    assert packed.cu_seqlens_cpu == tuple(packed.cu_seqlens.tolist())  # the same offsets on the host
    assert torch.equal(packed.labels[:-1], flat[1:])  # next token; verl never reads a sequence's last label
    assert torch.equal(packed.inv_temperature, torch.repeat_interleave(1.0 / temperature, lens))
    for seq_positions in positions:  # verl's position ids count from each first real token
        assert seq_positions.tolist() == list(range(len(seq_positions)))


def test_scalar_temperature_and_unpack_round_trip():
    data, ids, _ = _padded_sequences(3, 5, 5, seed=1)
    tu.assign_non_tensor(data, temperature=0.8)
    packed = batch.pack_micro_batch(data, torch.device("cpu"))
    assert torch.all(packed.inv_temperature == 1.0 / torch.tensor(0.8))
    nested = batch.unpack_to_nested(packed.input_ids[0].float(), packed)
    assert [t.long().tolist() for t in nested.unbind()] == [t.tolist() for t in ids]
    with pytest.raises(ValueError, match="per-token values"):
        batch.unpack_to_nested(torch.zeros(packed.num_tokens + 1), packed)


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("inf"), float("nan")])
def test_bad_temperature_refused_at_packing(temperature):
    """The head takes the packed inverse temperature as it is: packing is where a bad one stops."""
    data, _, _ = _padded_sequences(3, 5, 5, seed=1)
    data["temperature"] = torch.tensor([1.0, temperature, 1.0])
    with pytest.raises(ValueError, match="finite and > 0"):
        batch.pack_micro_batch(data, torch.device("cpu"))
    data, _, _ = _padded_sequences(3, 5, 5, seed=1)
    tu.assign_non_tensor(data, temperature=temperature)
    with pytest.raises(ValueError, match="finite and > 0"):
        batch.pack_micro_batch(data, torch.device("cpu"))


def test_micro_batches_by_count():
    assert batch.split_micro_batches([3] * 5, use_dynamic_bsz=False, micro_batch_size=2, max_token_len=None) == [
        [0, 1],
        [2, 3],
        [4],
    ]
    with pytest.raises(ValueError, match="larger than the batch"):
        batch.split_micro_batches([3] * 2, use_dynamic_bsz=False, micro_batch_size=4, max_token_len=None)


@pytest.mark.parametrize("budget", [9, 16, 40])
def test_micro_batches_by_token_budget(budget):
    lens = [9, 1, 4, 7, 3, 3, 8, 2]
    bins = batch.split_micro_batches(lens, use_dynamic_bsz=True, micro_batch_size=None, max_token_len=budget)
    assert sorted(i for b in bins for i in b) == list(range(len(lens)))
    assert len(bins) == -(-sum(lens) // budget)
    loads = [sum(lens[i] for i in b) for b in bins]
    assert max(loads) - min(loads) <= max(lens)  # greedy longest-first balance bound
    assert all(b == sorted(b) for b in bins)
    with pytest.raises(ValueError, match="exceeds max_token_len"):
        batch.split_micro_batches(lens, use_dynamic_bsz=True, micro_batch_size=None, max_token_len=8)


def test_verl_postprocess_restores_batch_order_from_our_indices():
    """The engines hand their micro-batch index lists to verl's `postprocess_batch_func`."""
    from verl.workers.engine.utils import postprocess_batch_func

    rows = [torch.arange(n, dtype=torch.float32) + 10 * i for i, n in enumerate([2, 3, 1, 4])]
    bins = [[1, 3], [0, 2]]
    outputs = [
        {
            "model_output": {"log_probs": torch.nested.as_nested_tensor([rows[i] for i in b], layout=torch.jagged)},
            "loss": float(k),
            "metrics": {"m": k},
        }
        for k, b in enumerate(bins)
    ]
    merged = postprocess_batch_func(outputs, bins, make_batch(4, 2, 2, seed=0))
    assert [t.tolist() for t in merged["model_output"]["log_probs"].unbind()] == [r.tolist() for r in rows]
    assert merged["loss"] == [0.0, 1.0] and merged["metrics"] == {"m": [0, 1]}


@pytest.mark.parametrize("switch", batch.UNSUPPORTED_SWITCHES)
def test_unsupported_switches_raise(switch):
    data = make_batch(2, 3, 3, seed=2)
    batch.check_batch_options(data)
    tu.assign_non_tensor(data, **{switch: True})
    with pytest.raises(ValueError, match=switch):
        batch.check_batch_options(data)
