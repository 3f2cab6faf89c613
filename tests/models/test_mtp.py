"""Qwen3.5's multi-token-prediction (MTP) module: forward, loss and gradients against an fp64 reference
written here (transformers' main model and decoder layer, plain torch for the rest, one sequence at a
time), the shift inside packed rows, and packing invariance.

Tolerances (fp64 models; transformers computes rotary cos / sin, norms and the gated delta rule in fp32
whatever the model's dtype, so ~1e-7 relative is its floor):
    MTP hidden states, loss: relative 1e-5.
    gradients per parameter: relative 1e-4, as the fp32 comparison with transformers: a small gradient
    summed from cancelling terms (dt_bias's, entries 1e-8..1e-5) amplifies the floor, to 1.08e-5 on one CPU.
    packed row vs one sequence at a time (same ops, fp64): relative 1e-10.
"""

import pytest
import torch
import torch.nn.functional as F
import transformers
import verl_moe.models as vm
from tiny_models import randomize_norms, save_checkpoint_with_mtp, tiny_qwen3_5_moe_text
from verl_moe.models.mtp import mtp_targets, mtp_valid_counts, shift_left

LENGTHS = (7, 3, 9)  # one sequence shorter than depth + 2: it has no valid position


def rel(ref: torch.Tensor, out: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@pytest.fixture(scope="module", params=[1, 2], ids=["depth1", "depth2"])
def mtp_model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"mtp{request.param}")
    config = tiny_qwen3_5_moe_text()
    save_checkpoint_with_mtp(config, folder, num_layers=request.param)
    model = vm.from_pretrained(folder, dtype=torch.float64, ops=vm.OpsConfig(router_dtype="fp64"))
    randomize_norms(model)  # the main model's norms start as the identity in transformers' save
    return model


def packed_batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (1, sum(LENGTHS)), generator=gen)
    loss_mask = (torch.rand(1, sum(LENGTHS), generator=gen) < 0.7).to(torch.int64)
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return ids, pos, cu, loss_mask


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


class Reference:
    """fp64, one sequence at a time: transformers' Qwen3.5-MoE for the main hidden states, transformers'
    decoder layer for each MTP layer, plain torch for the norms, fc, shift and cross-entropy. Holds its
    own leaf copies of every weight (names as ours) so gradients compare by name."""

    def __init__(self, model: vm.MoeCausalLM):
        config = model.config
        config._attn_implementation = "eager"
        config._experts_implementation = "eager"  # the grouped-mm path refuses fp64
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.hf = transformers.Qwen3_5MoeForCausalLM(config).to(torch.float64)
        self.hf.load_state_dict({k: v for k, v in state.items() if not k.startswith("mtp.")}, strict=True)
        full_attention = config.layer_types.index("full_attention")
        self.layers = []
        for k in range(model.arch.mtp_num_hidden_layers):
            layer = transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeDecoderLayer(config, full_attention)
            prefix = f"mtp.layers.{k}."
            layer.to(torch.float64).load_state_dict(
                {n[len(prefix) :]: v for n, v in state.items() if n.startswith(prefix)}, strict=True
            )
            self.layers.append(layer)
        self.plain = {
            n: v.requires_grad_(True) for n, v in state.items() if n.startswith("mtp.") and ".layers." not in n
        }
        self.eps = config.rms_norm_eps

    def params(self) -> dict[str, torch.Tensor]:
        out = dict(self.hf.named_parameters()) | self.plain
        for k, layer in enumerate(self.layers):
            out |= {f"mtp.layers.{k}.{n}": p for n, p in layer.named_parameters()}
        return out

    def sequence(self, ids: torch.Tensor, loss_mask: torch.Tensor):
        """ids, loss_mask [L] -> (per depth: hidden [L-k, D] at the positions whose token t+k exists, and
        (sum of CE over valid positions, their count))."""
        L, p = ids.shape[0], self.plain
        hidden = self.hf.model(input_ids=ids[None], position_ids=torch.arange(L)[None]).last_hidden_state[0]
        embed, head = self.hf.model.embed_tokens.weight, self.hf.lm_head.weight
        hiddens, losses = [], []
        for k, layer in enumerate(self.layers, start=1):
            n = L - k  # positions t with token t+k in the sequence
            if n <= 0:
                break
            x = (
                torch.cat(
                    [
                        rms(F.embedding(ids[k:], embed), p["mtp.pre_fc_norm_embedding.weight"], self.eps),
                        rms(hidden[:n], p["mtp.pre_fc_norm_hidden.weight"], self.eps),
                    ],
                    dim=-1,
                )
                @ p["mtp.fc.weight"].T
            )
            cos_sin = self.hf.model.rotary_emb(x[None], torch.arange(n)[None])
            mask = torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)[None, None]
            y = layer(x[None], position_embeddings=cos_sin, attention_mask=mask)[0]
            hidden = rms(y, p["mtp.norm.weight"], self.eps)
            hiddens.append(hidden)
            # position t predicts token t+k+1: valid for t < L-k-1 where loss_mask marks that token
            m = loss_mask[k + 1 :].to(torch.bool)
            ce = F.cross_entropy(hidden[: L - k - 1] @ head.T, ids[k + 1 :], reduction="none")
            losses.append((ce[m].sum(), int(m.sum())))
        return hiddens, losses


def our_losses(model, ids, pos, cu, loss_mask):
    """(depth hidden states [n, 1, T, D], per-depth CE sums over valid positions [n], their counts [n])."""
    n = model.arch.mtp_num_hidden_layers
    hidden = model(ids, pos, cu).last_hidden_state
    depths = model.mtp_hidden_states(hidden, ids, pos, cu)
    labels, mask = mtp_targets(ids, loss_mask, n, cu)
    ce = F.cross_entropy(model.logits(depths).flatten(0, 2), labels.flatten(), reduction="none").view(labels.shape)
    return depths, (ce * mask).sum(dim=(1, 2)), mask.sum(dim=(1, 2))


def test_mtp_forward_loss_and_grads_match_reference(mtp_model):
    model = mtp_model
    model.zero_grad(set_to_none=True)
    ids, pos, cu, loss_mask = packed_batch()
    n, scale = model.arch.mtp_num_hidden_layers, 0.3
    depths, ce_sums, counts = our_losses(model, ids, pos, cu, loss_mask)
    # Megatron's loss: per depth the mean over valid positions, averaged over depths, times the factor
    loss = scale / n * (ce_sums / counts.clamp_min(1)).sum()
    loss.backward()

    ref = Reference(model)
    ref_sums, ref_counts = [torch.zeros((), dtype=torch.float64) for _ in range(n)], [0] * n
    for s, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        hiddens, losses = ref.sequence(ids[0, start:end], loss_mask[0, start:end])
        for k, h in enumerate(hiddens):
            got = depths[k, 0, start : start + h.shape[0]]
            assert rel(h, got) < 1e-5, f"sequence {s} depth {k + 1}: MTP hidden rel {rel(h, got):.2e}"
        for k, (ce, count) in enumerate(losses):
            ref_sums[k] = ref_sums[k] + ce
            ref_counts[k] += count
    assert counts.tolist() == ref_counts
    assert counts.min() > 0  # every depth has valid positions in this batch
    ref_loss = scale / n * sum(s / c for s, c in zip(ref_sums, ref_counts))
    assert rel(ref_loss.detach(), loss.detach()) < 1e-5
    ref_loss.backward()
    ref_params, compared = ref.params(), 0
    for name, p in model.named_parameters():
        ref_grad = ref_params[name].grad
        if p.grad is None:  # only the main layers after the last attention layer... none in this model
            assert ref_grad is None or ref_grad.abs().max() == 0, name
            continue
        assert rel(ref_grad, p.grad) < 1e-4, f"{name}: grad rel {rel(ref_grad, p.grad):.2e}"
        compared += 1
    assert any(n.startswith("mtp.layers.") for n, p in model.named_parameters() if p.grad is not None)
    assert compared > len(list(model.named_parameters())) // 2


def test_packed_row_equals_one_sequence_at_a_time(mtp_model):
    model = mtp_model
    ids, pos, cu, loss_mask = packed_batch(seed=1)
    with torch.no_grad():
        depths, ce_sums, counts = our_losses(model, ids, pos, cu, loss_mask)
        alone_sums, alone_counts = torch.zeros_like(ce_sums), torch.zeros_like(counts)
        for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
            one = (ids[:, start:end], pos[:, start:end], torch.tensor([0, end - start]), loss_mask[:, start:end])
            d, s, c = our_losses(model, *one)
            alone_sums, alone_counts = alone_sums + s, alone_counts + c
            L = end - start
            for k in range(model.arch.mtp_num_hidden_layers):
                valid = max(L - k - 1, 0)  # positions whose token t+k+1 exists
                assert rel(d[k, 0, :valid], depths[k, 0, start : start + valid]) < 1e-10
    assert torch.equal(counts, alone_counts)
    assert rel(alone_sums, ce_sums) < 1e-10


def test_shift_stays_inside_sequences():
    ids, _, cu, loss_mask = packed_batch()
    for k in (0, 1, 2, 4):
        shifted, valid = shift_left(ids, k, cu)
        for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
            L = end - start
            inside = max(L - k, 0)
            assert torch.equal(shifted[0, start : start + inside], ids[0, start + k : end])
            assert not valid[0, start + inside : end].any() and (shifted[0, start + inside : end] == 0).all()
    labels, mask = mtp_targets(ids, loss_mask, 2, cu)
    offsets = cu.to(torch.int64)
    assert mask.sum(dim=(1, 2)).tolist() == mtp_valid_counts(loss_mask[0], offsets, 2).tolist()
    # unpacked rows: each row is one sequence
    rows = ids[:, :6].reshape(2, 3)
    assert torch.equal(shift_left(rows, 1)[0], torch.tensor([[rows[0, 1], rows[0, 2], 0], [rows[1, 1], rows[1, 2], 0]]))


def test_no_mtp_layers_changes_nothing():
    model = vm.build(tiny_qwen3_5_moe_text(mtp_num_hidden_layers=0))
    assert not hasattr(model, "mtp") and not any(n.startswith("mtp.") for n in model.state_dict())
    assert sorted(model.state_dict()) == sorted(vm.build(tiny_qwen3_5_moe_text()).state_dict())
    with pytest.raises(ValueError, match="no MTP layers"):
        ids, pos, cu, _ = packed_batch()
        model.mtp_hidden_states(model(ids, pos, cu).last_hidden_state, ids, pos, cu)
    with pytest.raises(ValueError, match="mtp_use_dedicated_embeddings"):
        vm.build(tiny_qwen3_5_moe_text(mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=True))


def test_vision_language_model_carries_mtp_under_top_level_names():
    from tiny_models import tiny_qwen3_5_moe_vl

    model = vm.build(tiny_qwen3_5_moe_vl(mtp_num_hidden_layers=1))
    names = [n for n in model.state_dict() if n.startswith("mtp.")]
    assert "mtp.fc.weight" in names and "mtp.layers.0.mlp.experts.gate_up_proj" in names
    ids, pos, cu, _ = packed_batch()
    hidden = model(ids, pos[None].expand(3, 1, -1), cu).last_hidden_state
    assert model.mtp_hidden_states(hidden, ids, pos[None].expand(3, 1, -1), cu).shape == (1, *hidden.shape)


def test_detached_inputs_train_only_the_mtp_module_and_head(mtp_model):
    """verl's detach_encoder: the MTP loss reaches the MTP module and the shared lm_head, not the decoder."""
    model = mtp_model
    model.zero_grad(set_to_none=True)
    ids, pos, cu, loss_mask = packed_batch()
    hidden = model(ids, pos, cu).last_hidden_state
    depths = model.mtp_hidden_states(hidden, ids, pos, cu, detach_inputs=True)
    labels, mask = mtp_targets(ids, loss_mask, model.arch.mtp_num_hidden_layers, cu)
    ce = F.cross_entropy(model.logits(depths).flatten(0, 2), labels.flatten(), reduction="none")
    (ce * mask.flatten()).sum().backward()
    got = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert "lm_head.weight" in got and "mtp.fc.weight" in got
    assert not any(n.startswith("model.") for n in got), sorted(n for n in got if n.startswith("model."))
