"""What one backend run gets: the training settings every backend shares, verl's loss config for
them, and the JSON `Job` a launched worker reads."""

from __future__ import annotations

import gc
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

LOSS_MODES = {  # --loss -> verl ActorConfig fields (GSPO: the paper's clip range and aggregation)
    "grpo": dict(policy_loss={"loss_mode": "vanilla"}, loss_agg_mode="token-mean", clip_ratio=0.2),
    "gspo": dict(
        policy_loss={"loss_mode": "gspo"},
        loss_agg_mode="seq-mean-token-mean",
        clip_ratio_low=3e-4,
        clip_ratio_high=4e-4,
    ),
}


@dataclass(frozen=True)
class TrainSettings:
    """What every backend must do identically: the loss, optimizer and schedule."""

    loss: str = "grpo"
    lr: float = 1e-4
    warmup_steps: int = 0
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    clip_grad: float = 1.0
    temperature: float = 1.0
    probe_budget: int = 4_000_000


@dataclass(frozen=True)
class Job:
    """Everything one backend run needs; JSON-serialisable so the distributed worker can read it."""

    backend: str  # the backend text, parsed again by the worker
    model_dir: str
    stream_path: str  # torch.save'd list of padded verl batches (with old_log_probs)
    trace_path: str
    train: TrainSettings = field(default_factory=TrainSettings)
    world_size: int = 1

    def dump(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> Job:
        d = json.loads(Path(path).read_text())
        d["train"] = TrainSettings(**{**d["train"], "betas": tuple(d["train"]["betas"])})
        return cls(**d)

    def stream(self) -> list[dict[str, torch.Tensor]]:
        """The padded batches of `stream_path`, one per optimizer step."""
        return torch.load(self.stream_path, weights_only=True)  # a list of dicts of tensors


def actor_config(train: TrainSettings):
    """verl's ActorConfig for `train.loss` (entropy coefficient 0, no KL loss)."""
    from verl.workers.config import ActorConfig

    return ActorConfig(
        strategy="fsdp2",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=-1,
        entropy_coeff=0.0,
        use_kl_loss=False,
        **LOSS_MODES[train.loss],
    )


def lr_schedule(train: TrainSettings, optimizer):
    from verl.utils.torch_functional import get_constant_schedule_with_warmup

    return get_constant_schedule_with_warmup(optimizer, num_warmup_steps=train.warmup_steps)


def release_device_memory() -> None:
    """Return this process's cached accelerator memory (the fp64 model it built is garbage now)."""
    from verl_moe.ops import device

    gc.collect()
    device.empty_cache()
