"""Model specs for Qwen3.5-MoE and Qwen3-MoE on verl_moe ops.

`build(hf_config, dtype, device, ops)` gives a `MoeCausalLM` whose parameter names equal
transformers' `...ForCausalLM` (a `MoeVisionLM`, names of `Qwen3_5MoeForConditionalGeneration`,
for the vision-language `qwen3_5_moe` config; `mrope_position_ids` gives its image position ids);
`from_pretrained` / `save_pretrained` read and write HF folders;
`to_vllm_named_tensors` names weights for vLLM; `get_spec(model_type)` is the registry.
"""

from .arch import ArchConfig
from .causal_lm import MoeCausalLM, MoeModelOutput
from .factory import build
from .ops_config import OpsConfig
from .qwen3_5_moe.rope_index import mrope_position_ids
from .qwen3_5_moe.vl_model import MoeVisionLM
from .registry import SPECS, ModelSpec, get_spec
from .weights import from_pretrained, load_checkpoint, save_pretrained, to_vllm_named_tensors

__all__ = [
    "SPECS",
    "ArchConfig",
    "ModelSpec",
    "MoeCausalLM",
    "MoeModelOutput",
    "MoeVisionLM",
    "OpsConfig",
    "build",
    "from_pretrained",
    "get_spec",
    "load_checkpoint",
    "mrope_position_ids",
    "save_pretrained",
    "to_vllm_named_tensors",
]
