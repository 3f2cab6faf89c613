"""Our kernels inside the anchors' own models.

- `integrations.veomni`: VeOmni kernel-registry entries named `verl_moe` (registered by our `verl.plugins`
  entry point, so `import verl` is enough); verl's VeOmni engine then selects them by config.
- `integrations.transformers`: `apply_to_qwen3_5_moe` / `apply_to_qwen3_moe` (and `revert_*`) swap
  transformers' Qwen3.5-MoE / Qwen3-MoE kernels for ours, on the classes or on one model.
- `integrations.adapters`: our ops in those models' calling conventions.

This layer sits beside `engines`: it imports `ops` (and `models`); only the plugin's registration and the
`tools` import it. docs/integrations.md has the slot table and what is not covered.
"""
