"""`models/mtp_decode.py`: the main model fed in chunks with every token's hidden state, the MTP layer's
decode step over its own KV cache, and the copy / restore of the slots' recurrent state.

Tolerances (fp32, the same ops in another packing):
| what                                                               | tol (max abs) |
| MoeDecoder.extend in chunks vs one forward of the whole sequence       | 1e-5          |
| MtpDrafter in chunks vs `MoeCausalLM.mtp_hidden_states`            | 1e-5          |
| restored state                                                     | bitwise       |
"""

import pytest
import torch
import verl_moe.models as vm
from tiny_models import randomize_norms, tiny_qwen3_5_moe_text
from verl_moe.models.decode import MoeDecoder
from verl_moe.models.mtp_decode import MtpDrafter

TOL = 1e-5


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = vm.build(tiny_qwen3_5_moe_text(mtp_num_hidden_layers=1))
    randomize_norms(m)
    return m.eval()


def test_chunks_equal_one_forward(model):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 128, (1, 13), generator=gen)
    pos = torch.arange(13)[None]
    with torch.no_grad():
        hidden = model(ids, pos).last_hidden_state[0]
        mtp = model.mtp_hidden_states(hidden[None], ids, pos)[0, 0]
    decoder = MoeDecoder(model)
    state = decoder.allocate(3, 16)
    cuts = [(0, 5), (5, 6), (6, 10), (10, 13)]
    chunks = [decoder.extend([ids[0, a:b].tolist()], state, [2]) for a, b in cuts]
    assert (torch.cat(chunks) - hidden).abs().max() <= TOL
    assert state.lengths.tolist() == [0, 0, 13]

    drafter = MtpDrafter(decoder)
    cache = drafter.allocate(3, 16)
    # position s: main hidden at s and token s + 1; the last position has no next token in `ids`
    outs = [drafter.forward(hidden[a:b], [ids[0, a + 1 : b + 1].tolist()], cache, [1], [a]) for a, b in cuts[:3]]
    outs.append(drafter.forward(hidden[10:12], [ids[0, 11:13].tolist()], cache, [1], [10]))
    assert (torch.cat(outs) - mtp[:12]).abs().max() <= TOL


def test_step_equals_forward_at_one_position(model):
    """`MtpDrafter.step` (device tensors, rows in other slots at other positions, one row inactive) gives
    `forward`'s output and cache entries at each active row's position, and leaves the inactive row's slot
    as it was."""
    gen = torch.Generator().manual_seed(2)
    drafter = MtpDrafter(MoeDecoder(model))
    hidden = torch.randn(3, 9, model.arch.hidden_size, generator=gen)
    tokens = torch.randint(1, 128, (3, 9), generator=gen)
    cache, ref = drafter.allocate(4, 16), drafter.allocate(4, 16)
    slots, starts = [2, 0, 3], [5, 8, 3]
    for c in (cache, ref):  # the positions before each row's
        drafter.forward(torch.cat([hidden[n, :s] for n, s in enumerate(starts)]),
                        [tokens[n, :s].tolist() for n, s in enumerate(starts)], c, slots, [0, 0, 0])  # fmt: skip
    want = drafter.forward(
        torch.stack([hidden[n, s] for n, s in enumerate(starts)]),
        [[int(tokens[n, s])] for n, s in enumerate(starts)], ref, slots, starts,
    )  # fmt: skip
    before = cache.attention.k.clone()
    active = torch.tensor([True, True, False])
    out = drafter.step(
        torch.stack([hidden[n, s] for n, s in enumerate(starts)])[:, None],
        torch.stack([tokens[n, s] for n, s in enumerate(starts)])[:, None],
        torch.tensor(starts)[:, None], cache, torch.tensor(slots), active,
    )[:, 0]  # fmt: skip
    assert (out[:2] - want[:2]).abs().max() <= TOL
    for n in range(2):
        got, ref_k = cache.attention.k[slots[n], :, : starts[n] + 1], ref.attention.k[slots[n], :, : starts[n] + 1]
        assert (got - ref_k).abs().max() <= TOL
    assert torch.equal(cache.attention.k[slots[2]], before[slots[2]])


def test_step_over_several_positions_equals_forward(model):
    """`MtpDrafter.step` over T positions per row with a per-position mask (a speculative round's catch-up: row n
    consumes its first counts[n] positions) gives `forward`'s output and cache entries at every consumed
    position, and writes nothing at the masked ones."""
    gen = torch.Generator().manual_seed(3)
    drafter = MtpDrafter(MoeDecoder(model))
    T, D = 4, model.arch.hidden_size
    hidden = torch.randn(3, 9 + T, D, generator=gen)
    tokens = torch.randint(1, 128, (3, 9 + T), generator=gen)
    cache, ref = drafter.allocate(4, 16), drafter.allocate(4, 16)
    slots, starts, counts = [3, 1, 0], [2, 9, 5], [4, 1, 2]
    for c in (cache, ref):
        drafter.forward(torch.cat([hidden[n, :s] for n, s in enumerate(starts)]),
                        [tokens[n, :s].tolist() for n, s in enumerate(starts)], c, slots, [0, 0, 0])  # fmt: skip
    want = drafter.forward(
        torch.cat([hidden[n, s : s + c] for n, (s, c) in enumerate(zip(starts, counts))]),
        [tokens[n, s : s + c].tolist() for n, (s, c) in enumerate(zip(starts, counts))], ref, slots, starts,
    )  # fmt: skip
    before = cache.attention.k.clone()
    positions = torch.tensor(starts)[:, None] + torch.arange(T)
    active = torch.arange(T)[None] < torch.tensor(counts)[:, None]
    rows = torch.arange(3)[:, None]
    out = drafter.step(hidden[rows, positions], tokens[rows, positions], positions, cache, torch.tensor(slots), active)
    assert (out[active] - want).abs().max() <= TOL
    for slot, s, c in zip(slots, starts, counts):
        assert (cache.attention.k[slot, :, : s + c] - ref.attention.k[slot, :, : s + c]).abs().max() <= TOL
        assert torch.equal(cache.attention.k[slot, :, s + c :], before[slot, :, s + c :])


def test_drafter_needs_mtp_layers():
    decoder = MoeDecoder(vm.build(tiny_qwen3_5_moe_text()))
    with pytest.raises(ValueError, match="needs the MTP layer"):
        MtpDrafter(decoder)
