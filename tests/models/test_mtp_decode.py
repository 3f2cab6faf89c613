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
        torch.stack([hidden[n, s] for n, s in enumerate(starts)]),
        torch.stack([tokens[n, s] for n, s in enumerate(starts)]),
        torch.tensor(starts), cache, torch.tensor(slots), active,
    )  # fmt: skip
    assert (out[:2] - want[:2]).abs().max() <= TOL
    for n in range(2):
        got, ref_k = cache.attention.k[slots[n], :, : starts[n] + 1], ref.attention.k[slots[n], :, : starts[n] + 1]
        assert (got - ref_k).abs().max() <= TOL
    assert torch.equal(cache.attention.k[slots[2]], before[slots[2]])


def test_drafter_needs_mtp_layers():
    decoder = MoeDecoder(vm.build(tiny_qwen3_5_moe_text()))
    with pytest.raises(ValueError, match="needs the MTP layer"):
        MtpDrafter(decoder)
