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


def test_drafter_needs_mtp_layers():
    decoder = MoeDecoder(vm.build(tiny_qwen3_5_moe_text()))
    with pytest.raises(ValueError, match="needs the MTP layer"):
        MtpDrafter(decoder)
