"""Our rollout through Ray (slow: a Ray cluster and two actor processes): the replica launches its
server actor beside a worker actor that holds the adapter, the server reaches the engine with
`__ray_call__`, and concurrent `generate` calls return what the engine computes in-process."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

pytestmark = pytest.mark.slow


def _worker_class():
    import ray

    @ray.remote(num_cpus=1)
    class Worker:
        """Stands in for verl's hybrid worker: builds the adapter in its process, takes weights."""

        def __init__(self, config):
            from types import SimpleNamespace

            from engine_setup import tiny_config
            from verl_moe.engines.rollout.adapter import MoeRolloutAdapter

            os.environ["RANK"] = "0"
            model_config = SimpleNamespace(
                hf_config=tiny_config(), generation_config=SimpleNamespace(eos_token_id=None), tokenizer=None
            )
            self.rollout = MoeRolloutAdapter(config, model_config)

        async def update_weights(self, state_dict, global_steps):
            import verl_moe.models as vm

            await self.rollout.resume(["weights"])
            await self.rollout.update_weights(vm.to_vllm_named_tensors(state_dict.items()), global_steps=global_steps)

    return Worker


def test_replica_server_generates_through_ray(tmp_path):
    import ray
    from test_rollout import PROMPTS, _model, _rollout_config
    from verl.workers.rollout.replica import RolloutMode
    from verl_moe.engines.rollout.engine import GenerationEngine, Request
    from verl_moe.engines.rollout.replica import MoeRolloutReplica
    from verl_moe.engines.rollout.sampling import SamplingParams

    here = os.path.dirname(os.path.abspath(__file__))
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": here}})
    try:
        model = _model()
        config = _rollout_config(response_length=6)
        worker = _worker_class().remote(config)
        ray.get(worker.update_weights.remote({n: t.clone() for n, t in model.state_dict().items()}, 7))
        replica = MoeRolloutReplica(replica_rank=0, config=config, model_config=None, gpus_per_node=1)
        replica.rollout_mode, replica.workers = RolloutMode.HYBRID, [worker]
        asyncio.run(replica.launch_servers())
        server = replica.server_handle
        greedy = {"temperature": 0, "top_p": 1.0, "top_k": -1, "logprobs": True}
        outs = ray.get([server.generate.remote(list(p), dict(greedy), f"r{i}") for i, p in enumerate(PROMPTS)])
        expected = GenerationEngine(model, []).generate(
            [
                Request(f"r{i}", p, SamplingParams(max_tokens=6, temperature=0, logprobs=True))
                for i, p in enumerate(PROMPTS)
            ]
        )
        for out, ref in zip(outs, expected):
            assert out.token_ids == ref.token_ids and out.extra_fields["global_steps"] == 7
            # the server batches the requests as they arrive (other batch sizes, other GEMM row counts than
            # the reference's one batch): fp32 last-bit differences, within the rollout's fp32 bound
            assert torch.allclose(torch.tensor(out.log_probs), torch.tensor(ref.log_probs), atol=1e-5, rtol=0)
        asyncio.run(replica.sleep())  # frees the worker's rollout model
        with pytest.raises(ray.exceptions.RayTaskError, match="no weights"):
            ray.get(server.generate.remote([1, 2], dict(greedy), "after-sleep"))
    finally:
        ray.shutdown()
