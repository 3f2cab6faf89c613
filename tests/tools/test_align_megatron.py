"""The megatron backend of `verl-moe align`: HF <-> megatron weight layout, and megatron-core's
GPTModel against our fp64 reference.

CPU: the conversion (exact round trip; the fused-QKV layout against a hand-built example) needs no
megatron. With megatron-core installed, GPTModel runs forward + backward on CPU after stand-ins for
the CUDA-only calls on its path (`_megatron_on_cpu`: it is not the backend, which needs CUDA and says
so; for Qwen3.5-MoE also fla's two calls in GatedDeltaNet): its fp32 log-probs, entropy, loss,
gradients (mapped to HF names) and routing must equal the fp64 reference at fp32 precision.
megatron's optimizer creates CUDA tensors, so the K-step runs are GPU tests (`align.run` with the
backend itself).

Tolerances (megatron fp32 vs reference fp64, tiny preset):
| quantity                            | bound                  |
| log-prob, entropy (max abs)         | 1e-5                   |
| loss (abs)                          | 1e-6                   |
| gradient per parameter group        | rel-RMS 1e-5           |
| total gradient norm                 | rel 1e-5               |
| router top-k sets                   | identical              |
| real tokens under other padding ids | max abs 1e-6           |
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import replace

import pytest
import torch
from dist import spawn
from verl_moe.ops.compare import assert_rel_rms
from verl_moe.tools.align import data
from verl_moe.tools.align.backends import megatron as am
from verl_moe.tools.align.backends import megatron_names as names
from verl_moe.tools.align.backends import parse_backend, unavailable
from verl_moe.tools.align.backends.reference import fill_old_log_probs, run_reference
from verl_moe.tools.align.data import to_verl
from verl_moe.tools.align.job import Job, TrainSettings, actor_config
from verl_moe.tools.align.trace import Probe, gather_cat, response_values

LOGP_MAX_ABS = 1e-5
LOSS_ABS = 1e-6
GRAD_REL_RMS = 1e-5
GRAD_NORM_REL = 1e-5
PAD_INVARIANCE = 1e-6


def _arch(preset: str, **overrides):
    from verl_moe import models

    config = data.hf_config(replace(data.get_preset(preset), config={**data.PRESETS[preset].config, **overrides}))
    spec = models.get_spec(config.model_type)
    return spec.arch_config(spec.text_config(config)), config


# ---- conversion (no megatron needed) -----------------------------------------------------------


def test_fuse_qkv_matches_hand_built_megatron_layout():
    H, HKV, K, D = 6, 2, 3, 5  # 3 query heads per KV group
    q, k, v = (torch.randn(n * K, D, dtype=torch.float64) for n in (H, HKV, HKV))
    expected_rows = []  # megatron's layout, written out group by group
    for g in range(HKV):
        for head in range(g * H // HKV, (g + 1) * H // HKV):
            expected_rows += [q[head * K + j] for j in range(K)]
        expected_rows += [k[g * K + j] for j in range(K)]
        expected_rows += [v[g * K + j] for j in range(K)]
    fused = names.fuse_qkv(q, k, v, HKV)
    assert torch.equal(fused, torch.stack(expected_rows))
    assert not torch.equal(fused, torch.cat([q, k, v]))  # the example tells the layouts apart
    for got, want in zip(names.split_qkv(fused, H, HKV, K), (q, k, v)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("overrides", [{}, {"mlp_only_layers": [1]}], ids=["all-moe", "dense-layer-1"])
def test_hf_megatron_round_trip_is_exact(overrides):
    from verl_moe import models

    arch, config = _arch("tiny-qwen3-moe", **overrides)
    hf = models.build(config, dtype=torch.float32).state_dict()
    mc = names.hf_to_megatron(hf, arch)
    assert len(mc) == len(set(mc))
    back = names.megatron_to_hf(mc, arch)
    assert sorted(back) == sorted(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name
    experts = [n for n in mc if ".local_experts." in n]
    moe_layers = sum(t == "moe" for t in arch.mlp_types)
    assert len(experts) == 2 * arch.num_experts * moe_layers
    assert ("decoder.layers.1.mlp.linear_fc1.weight" in mc) == bool(overrides)


def test_qwen35_features_without_gated_delta_net_are_refused_with_the_reason():
    arch, _ = _arch("tiny-qwen3.5-moe")
    names.check_supported(arch)  # the hybrid stack converts
    with pytest.raises(ValueError, match="without GatedDeltaNet"):
        names.check_supported(replace(arch, layer_types=("full_attention",) * len(arch.layer_types)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the reason given on a machine without CUDA")
def test_backend_is_skipped_on_cpu_with_the_reason():
    reason = unavailable(parse_backend("megatron"))
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        assert "not installed" in reason
    else:
        assert "CUDA" in reason and "torch.cuda.current_device" in reason


# ---- megatron-core on CPU ----------------------------------------------------------------------


def _megatron_on_cpu() -> None:
    """Stand-ins for the CUDA-only calls on GPTModel's forward/backward path, in this process only
    (and for fla, which megatron's GatedDeltaNet imports and which needs CUDA: its
    `chunk_gated_delta_rule` -> megatron's own torch fallback `torch_chunk_gated_delta_rule` (16-token
    chunks, not 64: the same result, its per-row loop 4x shorter on these <= 32-token rows), fla's
    `l2norm` -> our ops reference's; megatron's conv1d falls back to nn.Conv1d without causal_conv1d;
    torch.compile (megatron's `jit_fuser` on the gated norm) off: eager, 8 s of inductor saved):
    `torch.cuda.current_device()` (rotary frequencies, router weight, DDP buffers) -> "cpu";
    `torch.cuda.current_stream()` (megatron >= 0.19 DDP waits there for CUDA-graph events, none
    here) -> None; the model-parallel RNG fork around attention dropout (p = 0 here) -> no-op;
    megatron-core < 0.17's missing `te_general_gemm` -> None, the value 0.17 defines without
    TransformerEngine."""
    from megatron.core.ssm import gated_delta_net
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer.moe import moe_utils
    from verl_moe.ops.gdn.reference import _l2norm

    torch._dynamo.config.disable = True
    gated_delta_net.HAVE_FLA = True
    gated_delta_net.l2norm = lambda x: _l2norm(x.float()).to(x.dtype)
    gated_delta_net.chunk_gated_delta_rule = functools.partial(
        gated_delta_net.torch_chunk_gated_delta_rule, chunk_size=16
    )
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.current_stream = lambda *args, **kwargs: None
    megatron_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _megatron_step0(rank: int, world: int, model_dir: str, stream_path: str, out_path: str) -> None:
    """One rank: megatron fp32 forward + backward of this rank's rows of batch 0 (data parallel over
    `world`), then the log-probs again with another padding token. Rank 0 saves the gathered
    outputs and the reduced gradients under HF names."""
    from megatron.core import parallel_state

    _megatron_on_cpu()
    parallel_state.initialize_model_parallel()
    try:
        batch = torch.load(stream_path, weights_only=False)[0]
        n = batch["input_ids"].shape[0]
        rows = slice(rank * n // world, (rank + 1) * n // world)
        local = {key: v[rows] for key, v in batch.items()}
        td = to_verl(local, 1.0, global_batch_size=n)
        mm = am.build_megatron(model_dir, "fp32", "fp32", torch.device("cpu"), token_dispatcher="allgather")
        out = am.forward_backward(mm, td, 1.0, actor_config(TrainSettings()), dp_size=world)
        grads = {name: g.clone() for name, g in mm.named_main_grads().items()}
        loss = torch.tensor([out["loss"].item()], dtype=torch.float64)
        torch.distributed.all_reduce(loss)
        am.PAD_TOKEN = 7  # a real vocabulary id in every padded slot: real tokens must not see it
        td = to_verl(local, 1.0, global_batch_size=n)
        repadded = am.forward_backward(mm, td, 1.0, actor_config(TrainSettings()), dp_size=world)
        result = {
            "log_probs": gather_cat(response_values(out["log_probs"], td), world),
            "entropy": gather_cat(response_values(out["entropy"], td), world),
            "loss": loss.item() / world,
            "grads": grads,
            "topk": gather_cat(out["topk"], world),
            "log_probs_repadded": gather_cat(response_values(repadded["log_probs"], td), world),
        }
        if rank == 0:
            torch.save(result, out_path)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.dist
@pytest.mark.parametrize(
    "preset_name, overrides, world",
    [
        ("tiny-qwen3-moe", {}, 1),
        ("tiny-qwen3-moe", {"mlp_only_layers": [1]}, 1),
        ("tiny-qwen3-moe", {}, 2),
        ("tiny-qwen3.5-moe", {}, 1),
    ],
    ids=["all-moe", "dense-layer-1", "all-moe-dp2", "qwen3.5-gdn"],
)
@pytest.mark.usefixtures("needs_verl")
def test_megatron_fp32_matches_fp64_reference_on_cpu(tmp_path, preset_name, overrides, world):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'verl-moe[megatron]')")
    preset = data.get_preset(preset_name)
    preset = replace(preset, config={**preset.config, **overrides})
    model_dir = data.create_model_dir(preset, 0, tmp_path / "model")
    stream = data.make_stream(preset.stream, preset.config["vocab_size"], 1, seed=0)
    fill_old_log_probs(model_dir, stream, temperature=1.0)
    stream_path = tmp_path / "stream.pt"
    torch.save(stream, stream_path)
    job = Job("reference", str(model_dir), str(stream_path), str(tmp_path / "ref.pt"))
    golden = run_reference(job, parse_backend("reference"))
    step = golden.steps[0]

    out_path = tmp_path / "megatron.pt"
    spawn(_megatron_step0, world, str(model_dir), str(stream_path), str(out_path))
    got = torch.load(out_path, weights_only=False)

    assert (got["log_probs"] - step.log_probs).abs().max().item() < LOGP_MAX_ABS
    assert (got["entropy"] - step.entropy).abs().max().item() < LOGP_MAX_ABS
    assert abs(got["loss"] - step.loss) < LOSS_ABS
    grad_norm = torch.sqrt(sum(g.double().pow(2).sum() for g in got["grads"].values())).item()
    assert abs(grad_norm - step.grad_norm) / step.grad_norm < GRAD_NORM_REL
    probe = Probe({n: g.numel() for n, g in got["grads"].items()}, budget=TrainSettings().probe_budget)
    probed = probe.take(got["grads"])
    assert sorted(probed) == sorted(step.grads)
    for group, ref in step.grads.items():
        assert_rel_rms(f"grad[{group}]", ref, probed[group], GRAD_REL_RMS)
    assert len(got["topk"]) == len(step.topk)
    for layer, (ours, theirs) in enumerate(zip(step.topk, got["topk"])):
        assert torch.equal(ours, theirs), f"MoE layer {layer}: top-k sets differ"
    assert (got["log_probs_repadded"] - got["log_probs"]).abs().max().item() < PAD_INVARIANCE


# ---- the backend itself, on a GPU --------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.usefixtures("needs_verl")
def test_megatron_backend_aligns_with_reference_on_gpu(tmp_path, dtype):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'verl-moe[megatron]')")
    from verl_moe.tools import align

    backend = f"megatron:dtype={dtype}"
    reason = unavailable(parse_backend(backend))
    if reason:
        pytest.skip(reason)
    report = align.run(
        align.AlignConfig(
            preset="tiny-qwen3-moe",
            backends=("reference", backend),
            steps=3,
            out=str(tmp_path / "out"),
            world_size=1,
            progress=False,
        )
    )
    rows = {r["label"]: r for r in report["backends"]}
    assert rows[backend]["status"] == "ok", rows[backend]["reason"]
    (pair,) = report["pairs"]
    assert pair["precision"] == dtype
    assert pair["ok"], pair["first_exceeded"]
