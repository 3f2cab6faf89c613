"""A replay buffer for verl's v1 trainer that hands each batch over in an order fixed by its content.

verl's v1 trainer (`trainer.use_v1`, TransferQueue) lists a batch's trajectories in the order they
finished and names prompt groups with fresh uuids, so the same trajectories reach the trainer in
another order in every run. Sums over the batch (group advantages, the loss, gradients, metrics)
then round differently, and two runs with the same seed drift apart from the first step even when
every rollout repeats. This buffer sorts the batch by content: prompt groups by the set of their
sequences, trajectories within a group by their tokens. Trajectories it cannot tell apart hold the
same tokens in groups of the same tokens, so swapping them changes nothing the trainer computes
(unless two dataset rows with one prompt carry different per-row data, such as ground truths).

Enable it (sync trainer mode; verl builds custom samplers without `algorithm.filter_groups`; the CPU
recipes do, through `configs/determinism/`):

    trainer.v1.sampler.custom_sampler.path=pkg://verl_moe.engines.rollout.content_order
    trainer.v1.sampler.custom_sampler.name=ContentOrderedReplayBuffer

`+trainer.v1.sampler.sampler_kwargs.poll_interval=SECONDS` sets how often `sample` looks for a full
batch (verl's 2 s counts a 1.2 s generation as 2 s; 0.1 s lets a fast rollout's step go on sooner).

With `actor_rollout_ref.rollout.full_determinism=true` as well (sampling streams keyed by verl's
stable request ids, one request decoding at a time: `server.py`), two runs with the same seed log
the same metrics.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Sequence

import transfer_queue as tq
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

logger = logging.getLogger(__name__)


def content_order(keys: Sequence[str], sequences: Sequence[bytes]) -> list[int]:
    """The batch order by content: indices of `keys` sorted by their group's sorted sequences, then
    their own sequence; groups stay contiguous (the uid only separates groups of equal content,
    which are interchangeable). keys: verl's `{uid}_{session}_{index}` trajectory keys; sequences:
    each trajectory's tokens (prompt + response) as bytes."""
    groups: dict[str, list[bytes]] = defaultdict(list)
    uids = [key.split("_")[0] for key in keys]
    for uid, sequence in zip(uids, sequences):
        groups[uid].append(sequence)
    group_keys = {uid: tuple(sorted(members)) for uid, members in groups.items()}
    return sorted(range(len(keys)), key=lambda i: (group_keys[uids[i]], uids[i], sequences[i]))


class ContentOrderedReplayBuffer(ReplayBuffer):
    """verl's sync ReplayBuffer whose `sample` returns the batch in `content_order`.

    Raises:
        ValueError: a trainer mode other than "sync" (the async modes take trajectories as they
            finish, by design).
    """

    def __init__(self, trainer_mode: str, *args, **kwargs):
        if trainer_mode != "sync":
            raise ValueError(f"ContentOrderedReplayBuffer orders sync batches, got trainer_mode={trainer_mode!r}")
        poll = (kwargs.get("sampler_kwargs") or {}).get("poll_interval")
        if poll is not None:
            if float(poll) <= 0:
                raise ValueError(f"sampler_kwargs.poll_interval must be > 0 seconds, got {poll}")
            kwargs["poll_interval"] = float(poll)
        super().__init__(trainer_mode, *args, **kwargs)

    def sample(self, global_steps: int, partition_id: str, batch_size: int):
        """verl's `sample` (waits until the batch is complete), then the batch in content order. Logs how
        long the wait and the ordering took: with the rollout server's per-wave line, where the trainer's
        `timing_s/gen` goes."""
        start = time.perf_counter()
        batch, metrics = super().sample(global_steps, partition_id, batch_size)
        ready = time.perf_counter()
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["input_ids"])
        rows = data["input_ids"].unbind(0)  # jagged: one tensor per trajectory
        batch.reorder(content_order(batch.keys, [row.cpu().numpy().tobytes() for row in rows]))
        logger.info(
            "verl_moe replay buffer: %d trajectories ready after %.2f s, put in content order in %.3f s",
            len(batch.keys), ready - start, time.perf_counter() - ready,
        )  # fmt: skip
        return batch, metrics


__all__ = ["ContentOrderedReplayBuffer", "content_order"]
