"""verl-moe: verl engines for Qwen3.5-MoE / Qwen3-MoE with portable Triton ops.

Subpackages: `verl_moe.ops` (ops: reference + kernels + dispatch), `verl_moe.models` (model
specs), `verl_moe.engines` (verl engine backends), `verl_moe.configs` (Hydra YAML),
`verl_moe.tools` (the `verl-moe` CLI).
"""

__version__ = "0.1.0"
