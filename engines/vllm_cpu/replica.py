"""verl's vLLM replica and server actor on a CPU host (see the package docstring for why each change)."""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from verl.plugin.platform import get_platform
from verl.utils.net_utils import is_valid_ipv6_address
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

WORKER_EXTENSION = "verl_moe.engines.vllm_cpu.worker.CpuVllmWorkerExtension"


class CpuVllmHttpServer(vLLMHttpServer):
    """verl's vLLM server with our worker extension; refuses what vLLM-CPU cannot do before starting it."""

    def _validate_configs(self) -> None:
        super()._validate_configs()
        on = [key for key in ("enable_sleep_mode", "free_cache_engine") if getattr(self.config, key)]
        if on:
            raise ValueError(
                f"vLLM-CPU has no sleep mode: set {' and '.join(f'actor_rollout_ref.rollout.{k}=False' for k in on)}"
            )

    def _get_worker_extension_cls(self) -> str:
        return WORKER_EXTENSION


def _node_id(worker) -> str:
    return ray.get_runtime_context().get_node_id()


class CpuVllmReplica(vLLMReplica):
    """One server per replica on its workers' node, started without Ray accelerator ids (a CPU worker
    holds none). A replica spans one node."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.server_class = ray.remote(CpuVllmHttpServer)

    async def launch_servers(self):
        if len(self.workers) != self.world_size:
            raise ValueError(
                f"vLLM replica {self.replica_rank}: {len(self.workers)} workers, expected {self.world_size}"
            )
        if self.nnodes != 1:
            raise ValueError(f"the CPU vLLM rollout runs a replica on one node, this one spans {self.nnodes}")
        node_id = await self.workers[0].__ray_call__.remote(_node_id)
        role = "reward_" if self.is_reward_model else "teacher_" if self.is_teacher_model else ""
        platform = get_platform()
        server = self.server_class.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
            runtime_env={"env_vars": {**{v: "1" for v in platform.ray_noset_envvars()}, **platform.rollout_env_vars()}},
            name=f"{self._get_server_name_prefix()}server_{role}{self.replica_rank}_0{self.name_suffix}",
            max_concurrency=self.max_concurrency,
            num_cpus=0,  # it only serves requests; vLLM's engine processes compute
        ).remote(
            config=self.config,
            model_config=self.model_config,
            rollout_mode=self.rollout_mode,
            workers=self.workers,
            replica_rank=self.replica_rank,
            node_rank=0,
            gpus_per_node=self.gpus_per_replica_node,
            nnodes=1,
            cuda_visible_devices="",
        )
        self.servers.append(server)
        master_address, master_port, dp_rpc_port = await server.get_master_address.remote()
        await server.launch_server.remote(
            master_address=master_address, master_port=master_port, dp_rpc_port=dp_rpc_port
        )
        address, port = await server.get_server_address.remote()
        self._server_handle = server
        self._server_address = f"[{address}]:{port}" if is_valid_ipv6_address(address) else f"{address}:{port}"


__all__ = ["CpuVllmHttpServer", "CpuVllmReplica", "WORKER_EXTENSION"]
