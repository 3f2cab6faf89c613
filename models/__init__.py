"""Model specs for Qwen3.5-MoE and Qwen3-MoE on verl_moe ops.

`build(hf_config, dtype, device, ops)` gives a `MoeCausalLM` whose parameter names equal
transformers' `...ForCausalLM`; `from_pretrained` / `save_pretrained` read and write HF folders;
`to_vllm_named_tensors` names weights for vLLM; `get_spec(model_type)` is the registry.
"""

from .arch import ArchConfig
from .causal_lm import MoeCausalLM, MoeModelOutput, build
from .ops_config import OpsConfig
from .registry import SPECS, ModelSpec, get_spec
from .weights import from_pretrained, load_checkpoint, save_pretrained, to_vllm_named_tensors

__all__ = [
    "SPECS",
    "ArchConfig",
    "ModelSpec",
    "MoeCausalLM",
    "MoeModelOutput",
    "OpsConfig",
    "build",
    "from_pretrained",
    "get_spec",
    "load_checkpoint",
    "save_pretrained",
    "to_vllm_named_tensors",
]
