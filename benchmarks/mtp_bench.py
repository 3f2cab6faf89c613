"""Speculative decoding with Qwen3.5's MTP layer, measured: a reduced Qwen3.5-MoE with one MTP layer trained for a
few minutes on a synthetic corpus of known entropy, then our rollout engine with and without MTP drafts at 1, 8,
32 and 256 requests, in one process.

The corpus is an order-1 Markov chain over the token ids 1..states: each state has `branching` successors drawn
at random, with Dirichlet(1) probabilities (next-token entropy about 1.08 nats at branching 4; the chain's exact
stationary entropy is in the report as `corpus_entropy`). A model that learns it predicts well but not surely, so
drafts are kept and rejected. Training: AdamW in fp32 on the next-token loss plus `mtp_scale` x the MTP loss
(token t+2 from the hidden state at t and token t+1's embedding, Megatron's `mtp_loss_scaling_factor`), on
batches of corpus sequences, for `--train-seconds` after the first step (which compiles; `train_s` excludes
it). Then the weights go to a model in `--dtype` for generation: prompts of 32 corpus tokens, `--new-tokens`
tokens each at temperature 1 (`ignore_eos`), by `GenerationEngine` (device graphs on
cuda) and by `SpeculativeEngine` with k drafts per round, each timed on its second batch (the first compiles).

Report (`--json`, one JSON object): `mean_entropy` (the trained model's next-token entropy at temperature 1 on
held-out corpus sequences), `corpus_entropy`, `train_steps`, `train_s`, `loss`, `mtp_loss` (last step), and
`records`, one per (requests, k): `requests`, `k`, `tokens`, `plain_tokens_per_s`, `spec_tokens_per_s`,
`speedup` (spec over plain) and `acceptance` (draft tokens kept / drafted in the timed batch), and what the
rollout does with speculation on (`engines/rollout/routing.py`): `path` ("speculative" where the wave of requests
is at most `--max-speculative`, the rollout's `max_speculative`, else "plain": speculation steps aside) and
`rollout_speedup`, that path's tokens/s over plain's (1 where it steps aside).

python benchmarks/mtp_bench.py --json results/mtp_h100.json          # reduced model, on a GPU
python benchmarks/mtp_bench.py --layers 16 --json results/mtp_L16_h100.json   # the MTP layer 1/16 of the model
python benchmarks/mtp_bench.py --tiny --train-seconds 20 --requests 1,4 --new-tokens 16   # smoke run on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import verl_moe.models as vm
from transformers import Qwen3_5MoeTextConfig
from verl_moe.engines.rollout.config import RolloutOptions
from verl_moe.engines.rollout.engine import GenerationEngine, Request
from verl_moe.engines.rollout.sampling import SamplingParams
from verl_moe.engines.rollout.speculative import SpeculativeEngine
from verl_moe.ops import device as devices
from verl_moe.tools.provenance import environment


@dataclass(frozen=True)
class Chain:
    """An order-1 Markov chain over token ids 1..states: successors [states + 1, branching] (row 0 unused)
    and their probabilities."""

    successors: torch.Tensor
    probs: torch.Tensor

    @staticmethod
    def random(states: int, branching: int, seed: int) -> Chain:
        gen = torch.Generator().manual_seed(seed)
        successors = torch.stack([torch.randperm(states, generator=gen)[:branching] + 1 for _ in range(states + 1)])
        # normalised exponentials: Dirichlet(1, ..., 1)
        probs = -torch.log(torch.rand(states + 1, branching, generator=gen, dtype=torch.float64))
        return Chain(successors, probs / probs.sum(-1, keepdim=True))

    def transition_matrix(self) -> torch.Tensor:
        """[states, states] fp64: P[i, j] = probability of state j + 1 after state i + 1."""
        n = self.successors.shape[0] - 1
        P = torch.zeros(n, n, dtype=torch.float64)
        P.scatter_add_(1, self.successors[1:] - 1, self.probs[1:])
        return P

    def entropy(self) -> float:
        """The chain's next-token entropy in nats under its stationary distribution."""
        P = self.transition_matrix()
        pi = torch.full((P.shape[0],), 1.0 / P.shape[0], dtype=torch.float64)
        for _ in range(2000):  # power iteration; the random chain mixes fast
            pi = pi @ P
        row = -(self.probs[1:] * self.probs[1:].log()).sum(-1)
        return float(pi @ row)

    def sample(self, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
        """[n, length] token ids, each sequence from a uniform random start state."""
        states = self.successors.shape[0] - 1
        out = torch.empty(n, length, dtype=torch.long)
        out[:, 0] = torch.randint(1, states + 1, (n,), generator=gen)
        for t in range(1, length):
            prev = out[:, t - 1]
            pick = torch.multinomial(self.probs[prev], 1, generator=gen)[:, 0]
            out[:, t] = self.successors[prev, pick]
        return out


def model_config(tiny: bool, vocab: int, layers: int = 4) -> Qwen3_5MoeTextConfig:
    """The reduced Qwen3.5-MoE of `verl-moe bench` (`layers` layers, every fourth full attention, hidden 2048, 64
    experts top-8) with a vocabulary of `vocab` and one MTP layer; `tiny`: a few-thousand-parameter one for CPU
    smoke runs. The MTP layer is one decoder layer: 1 / layers of the main model's work per token (a quarter at
    4 layers, a few percent in the full Qwen3.5-MoE models of tens of layers), which bounds what speculation
    can gain here."""
    if tiny:
        sizes = dict(
            hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
        )  # fmt: skip
    else:
        sizes = dict(
            hidden_size=2048, num_hidden_layers=layers, full_attention_interval=4, num_attention_heads=16,
            num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
            linear_key_head_dim=128, linear_value_head_dim=128, num_experts=64, num_experts_per_tok=8,
            moe_intermediate_size=512, shared_expert_intermediate_size=512,
        )  # fmt: skip
    return Qwen3_5MoeTextConfig(
        vocab_size=vocab, linear_conv_kernel_dim=4, tie_word_embeddings=False, mtp_num_hidden_layers=1, **sizes
    )


def losses(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(next-token loss, MTP loss, main logits [B, T, V] fp32) over a batch of sequences [B, T]."""
    pos = torch.arange(ids.shape[1], device=ids.device)[None].expand_as(ids)
    hidden = model(ids, pos).last_hidden_state
    logits = model.logits(hidden).float()
    vocab = logits.shape[-1]
    main = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))
    mtp = model.logits(model.mtp_hidden_states(hidden, ids, pos)[0][:, :-2]).float()
    return main, F.cross_entropy(mtp.reshape(-1, vocab), ids[:, 2:].reshape(-1)), logits


def train(model, chain: Chain, args, dev) -> dict:
    gen = torch.Generator().manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    start, steps = time.perf_counter(), 0
    while time.perf_counter() - start < args.train_seconds and (not args.train_steps or steps < args.train_steps):
        ids = chain.sample(args.batch, args.seq_len, gen).to(dev)
        main, mtp, _ = losses(model, ids)
        opt.zero_grad(set_to_none=True)
        (main + args.mtp_scale * mtp).backward()
        opt.step()
        steps += 1
        if steps == 1:  # the first step compiles and autotunes: the time budget counts from its end
            devices.synchronize()
            start = time.perf_counter()
        if steps % 50 == 0:
            print(f"step {steps}: loss {main.item():.3f}, mtp loss {mtp.item():.3f}", file=sys.stderr, flush=True)
    with torch.no_grad():
        main, mtp, logits = losses(model, chain.sample(args.batch, args.seq_len, gen).to(dev))
        log_p = logits.log_softmax(-1)
        entropy = -(log_p.exp() * log_p).sum(-1).mean()
    return {
        "train_steps": steps,
        "train_s": time.perf_counter() - start,
        "loss": main.item(),
        "mtp_loss": mtp.item(),
        "mean_entropy": entropy.item(),
    }


def timed(engine, requests: list[Request]) -> float:
    """Seconds `engine` takes to generate `requests`, the device synchronised around it."""
    devices.synchronize()
    start = time.perf_counter()
    engine.generate(requests)
    devices.synchronize()
    return time.perf_counter() - start


def measure(model, chain: Chain, requests: int, ks: list[int], args) -> list[dict]:
    gen = torch.Generator().manual_seed(2 + requests)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=1.0, ignore_eos=True)

    def batch(tag: str) -> list[Request]:
        prompts = chain.sample(requests, 32, gen).tolist()
        return [Request(f"{tag}-{i}", tuple(p), params) for i, p in enumerate(prompts)]

    tokens = requests * args.new_tokens
    plain = GenerationEngine(model, [], seed=0, max_num_seqs=requests)
    plain.generate(batch("warm"))
    plain_s = timed(plain, batch("plain"))
    records = []
    for k in ks:
        spec = SpeculativeEngine(model, [], num_draft_tokens=k, max_num_seqs=requests)
        spec.generate(batch(f"warm{k}"))
        drafted, accepted = spec.stats.drafted, spec.stats.accepted
        spec_s = timed(spec, batch(f"spec{k}"))
        drafted, accepted = spec.stats.drafted - drafted, spec.stats.accepted - accepted
        records.append(
            {
                "requests": requests,
                "k": k,
                "tokens": tokens,
                "plain_tokens_per_s": tokens / plain_s,
                "spec_tokens_per_s": tokens / spec_s,
                "speedup": plain_s / spec_s,
                "acceptance": accepted / drafted if drafted else 0.0,
                "path": "speculative" if requests <= args.max_speculative else "plain",
                "rollout_speedup": plain_s / spec_s if requests <= args.max_speculative else 1.0,
            }
        )
        print(json.dumps(records[-1]), flush=True)
    return records


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny model (CPU smoke runs)")
    parser.add_argument("--layers", type=int, default=4, help="main decoder layers of the reduced model")
    parser.add_argument("--states", type=int, default=4096, help="token ids the corpus uses (1..states)")
    parser.add_argument("--branching", type=int, default=4, help="successors per state")
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--train-seconds", type=float, default=180.0)
    parser.add_argument("--train-steps", type=int, default=0, help="stop after this many steps too (0: time only)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--mtp-scale", type=float, default=0.3)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="the generating model's dtype")
    parser.add_argument("--requests", default="1,8,32,256")
    parser.add_argument("--k", default="1,2,3", help="draft tokens per round to measure")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--max-speculative",
        type=int,
        default=RolloutOptions.max_speculative,
        help="the rollout's max_speculative: larger waves decode plainly",
    )
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    if args.states >= args.vocab:
        parser.error(f"--states ({args.states}) must be below --vocab ({args.vocab}): id 0 is not in the corpus")
    dev = devices.current_device() if devices.is_accelerator() else torch.device("cpu")
    torch.manual_seed(0)
    chain = Chain.random(args.states, args.branching, seed=0)
    config = model_config(args.tiny, args.vocab, args.layers)
    model = vm.build(config, dtype=torch.float32, device=dev)
    report = {"tool": "mtp_bench", "argv": sys.argv, **environment(), "corpus_entropy": chain.entropy()}
    report.update(train(model, chain, args, dev))
    print(json.dumps({k: v for k, v in report.items() if k != "versions"}), flush=True)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    serving = vm.build(config, dtype=dtype, device=dev)
    serving.load_state_dict(model.state_dict())
    del model
    serving.eval().requires_grad_(False)
    ks = [int(k) for k in args.k.split(",")]
    report["records"] = []
    for requests in (int(n) for n in args.requests.split(",")):
        report["records"] += measure(serving, chain, requests, ks, args)
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
