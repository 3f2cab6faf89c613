"""verl-moe: verl engines for Qwen3.5-MoE / Qwen3-MoE with portable Triton ops.

Subpackages: `verl_moe.ops` (ops: reference + kernels + dispatch), `verl_moe.models` (model
specs, parallel groups and plans), `verl_moe.engines` (verl engine backends), `verl_moe.configs`
(Hydra YAML), `verl_moe.tools` (the `verl-moe` CLI).

One tree: in a source checkout this file is `<repo>/verl_moe/__init__.py` and the subpackages are the
repo's top-level folders (`<repo>/ops`, ...), so the package's search path is the repo root. Every
`verl_moe.<sub>` then resolves beside the `verl_moe` that was imported: from the repo root without
any install, through `pip install -e .`, and never mixed with another checkout's editable install
(whose finder only answers what this path does not hold). In a wheel the subpackages sit in this
folder and the path is left as it is.
"""

from pathlib import Path as _Path

__version__ = "0.1.0"

_here = _Path(__file__).resolve().parent
if not (_here / "ops").is_dir() and (_here.parent / "ops" / "__init__.py").is_file():
    __path__ = [str(_here.parent)]  # source checkout: the repo root is the package
del _Path, _here
