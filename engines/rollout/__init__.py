"""verl_moe's rollout backend (`actor_rollout_ref.rollout.name=verl_moe`): generation with our own
model spec and a real decode path, for CPU, CI and single-GPU runs (vLLM stays the rollout at scale).

- `replica.py`: verl's `RolloutReplica` (registered in `RolloutReplicaRegistry` by the plugin);
- `server.py`: the server actor verl's agent loop calls (`generate` -> `TokenOutput`, control methods);
- `adapter.py`: the per-rank `BaseRollout` (verl's `_ROLLOUT_REGISTRY` entry), holding the model and
  engine in the worker process and taking the weights each step;
- `engine.py`: continuous batching over `verl_moe.models.decode`; `sampling.py`: vLLM's sampling and
  processed log-probs; `weights.py`: vLLM / HF names -> our parameters; `config.py`:
  `engine_kwargs.verl_moe`;
- `content_order.py`: a replay buffer for verl's v1 trainer that orders each batch by content (repeatable runs).
Importing this package imports no Ray actor code beyond verl's own modules.

Its INFO lines (the decode slots' footprint when they are allocated, one summary per generation
wave) are logged at `VERL_LOGGING_LEVEL` (verl's switch; INFO when unset) and reach stderr also in
processes whose logging has no handler, such as Ray's workers and actors (Python's last resort
prints warnings only).
"""

import logging

from .config import ROLLOUT_NAME, RolloutOptions


class _WithoutRootHandler(logging.Filter):
    """Pass a record only while the root logger has no handler (else the root's prints it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not logging.getLogger().handlers


_logger = logging.getLogger(__name__)
if not _logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    _handler.addFilter(_WithoutRootHandler())
    _logger.addHandler(_handler)

ADAPTER_FQN = "verl_moe.engines.rollout.adapter.MoeRolloutAdapter"


def load_replica():
    """The replica class (verl's `RolloutReplicaRegistry` loader)."""
    from .replica import MoeRolloutReplica

    return MoeRolloutReplica


__all__ = ["ADAPTER_FQN", "ROLLOUT_NAME", "RolloutOptions", "load_replica"]
