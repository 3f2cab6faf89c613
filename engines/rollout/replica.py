"""verl's `RolloutReplica` for `rollout.name=verl_moe`: one server actor per replica, no HTTP.

verl builds replicas with `world_size = tensor_model_parallel_size * data_parallel_size *
pipeline_model_parallel_size` workers each (its `RolloutConfig` defaults TP to 2: set
`rollout.tensor_model_parallel_size=1` so every worker serves its own replica). The replica's
first worker holds the engine (`adapter.py`); its server actor (`server.py`) is placed on that
worker's node, asks Ray for no CPU (it only queues requests; the engine computes inside the
worker, within the worker's own Ray resources) and is named `verl_moe_server_<replica>`.
"""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from verl.workers.rollout.replica import RolloutReplica

from .server import MoeRolloutServer


def _node_id(worker) -> str:
    return ray.get_runtime_context().get_node_id()


class MoeRolloutReplica(RolloutReplica):
    """verl_moe's replica: hybrid (trainer workers), colocated and standalone (verl's
    CheckpointEngineWorker actors, which build our adapter) modes all put the engine in the
    replica's first worker process."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.server_class = ray.remote(MoeRolloutServer)

    async def launch_servers(self):
        if len(self.workers) != self.world_size:
            raise ValueError(
                f"verl_moe replica {self.replica_rank}: {len(self.workers)} workers, expected {self.world_size}"
            )
        node_id = await self.workers[0].__ray_call__.remote(_node_id)
        role = "reward_" if self.is_reward_model else "teacher_" if self.is_teacher_model else ""
        server = self.server_class.options(
            name=f"verl_moe_server_{role}{self.replica_rank}{self.name_suffix}",
            num_cpus=0,
            max_concurrency=self.max_concurrency,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
        ).remote(
            config=self.config, workers=self.workers, replica_rank=self.replica_rank, rollout_mode=self.rollout_mode
        )
        self.servers = [server]
        self._server_handle = server
        # verl keys its load balancer by address; there is no HTTP endpoint behind it.
        self._server_address = f"verl_moe-replica-{role}{self.replica_rank}{self.name_suffix}"

    async def sleep(self):
        await self.servers[0].sleep.remote()


__all__ = ["MoeRolloutReplica"]
