"""Our checkpoint folder -> a HuggingFace model folder: what `python -m verl.model_merger merge --backend fsdp`
does for verl's FSDP checkpoints, for the folders our engines write (`engines/checkpoint.py`).

    python -m verl_moe.engines.model_merger merge --local_dir <ckpt>/global_step_N/actor --target_dir <hf>
        [--config_dir <the trained model's HF folder>]

verl's merger reads `fsdp_config.json` and one `model_world_size_W_rank_R.pt` per rank; ours are one
torch.distributed.checkpoint (`dcp/`) plus, when `checkpoint.save_contents` holds `hf_model`, the
merged HF model itself (`huggingface/`). So:
- with `huggingface/`: copied to the target, nothing to merge;
- without it: the model is read from `dcp/` in this one process (any world size wrote it) into an
  unsharded copy built from `--config_dir`'s config.json (the checkpoint holds no config then), and
  written with `save_pretrained`.
Either way the non-weight files of `--config_dir` (tokenizer, chat template, generation config,
processor) are copied too, so the target is a complete model folder.

verl's merger cannot read our folders, and would fail with a traceback about `fsdp_config.json`; the
plugin (`engines/plugin.py`) calls `refusal` at `import verl` and stops that run with one line that
names this command instead.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import sys
import warnings

VERL_MERGER = ("verl.model_merger", "verl.model_merger.__main__")
COMMAND = "python -m verl_moe.engines.model_merger merge"
HF_EXPORT = "huggingface"
# files of an HF folder that hold weights (ours come from the checkpoint) or the config (written anew)
_NOT_COPIED = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


def _flag(args: list[str], name: str) -> str | None:
    """The value of `--name X` / `--name=X` in `args` (the last one wins, as argparse), else None."""
    value = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def _our_checkpoint(local_dir: str) -> str | None:
    """The complete folder our `load` would read for `local_dir`, or None when it is none of ours."""
    from .checkpoint import _newest_complete

    return _newest_complete(os.path.abspath(local_dir))


def refusal(argv: list[str]) -> str | None:
    """One line for a process started as `python -m verl.model_merger ... --local_dir <ours>`
    (`argv`: `sys.orig_argv`), naming our HF export and this module's command; None for any other
    process or folder (verl's own checkpoints keep verl's merger)."""
    if "-m" not in argv:
        return None
    i = argv.index("-m")
    if i + 1 >= len(argv) or argv[i + 1] not in VERL_MERGER:
        return None
    args = argv[i + 2 :]
    local_dir = _flag(args, "--local_dir")
    if local_dir is None or os.path.isfile(os.path.join(local_dir, "fsdp_config.json")):
        return None
    folder = _our_checkpoint(local_dir)
    if folder is None:
        return None
    target = _flag(args, "--target_dir") or "<hf dir>"
    export = os.path.join(folder, HF_EXPORT)
    has_export = os.path.isfile(os.path.join(export, "config.json"))
    config = "" if has_export else " --config_dir <the trained model's HF folder>"
    found = f"its merged HF model is {export}; to" if has_export else "it holds no HF export; to"
    return (
        f"verl_moe: {local_dir} is a verl_moe checkpoint (torch.distributed.checkpoint, no fsdp_config.json), "
        f"which verl.model_merger cannot read; {found} write one run: "
        f"{COMMAND} --local_dir {local_dir} --target_dir {target}{config}"
    )


def _copy_non_weights(source: str, target: str) -> None:
    for name in sorted(os.listdir(source)):
        path = os.path.join(source, name)
        if os.path.isfile(path) and name != "config.json" and not name.endswith(_NOT_COPIED):
            shutil.copy2(path, os.path.join(target, name))


def _model_from_dcp(dcp_dir: str, config_dir: str):
    """An unsharded model of `config_dir`'s config holding the weights of `dcp_dir` (in their saved dtype)."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig

    from ..models import build, get_spec
    from .checkpoint import CheckpointError, _check_dcp

    _check_dcp(dcp_dir)
    saved = {
        key[len("model.") :]: meta
        for key, meta in dcp.FileSystemReader(dcp_dir).read_metadata().state_dict_metadata.items()
        if key.startswith("model.")
    }
    config = AutoConfig.from_pretrained(config_dir)
    spec = get_spec(config.model_type)
    # the engines train a vision-language config's text decoder alone until they feed images
    text_only = spec.vision_arch is not None and not any(k.startswith("model.visual.") for k in saved)
    if spec.mtp_prefix and not any(k.startswith(spec.mtp_prefix) for k in saved):
        # trained with verl's model.mtp off: the engine's model had no MTP layers (verl zeroes their count)
        config = copy.deepcopy(config)
        spec.text_config(config).mtp_num_hidden_layers = 0
    dtype = next(iter(saved.values())).properties.dtype
    model = build(config, dtype=dtype, device="meta", text_only=text_only)
    model.to_empty(device="cpu")
    # a tied lm_head is the embedding's tensor: loading the embedding fills both
    tied = {"lm_head.weight"} if model.arch.tie_word_embeddings else set()
    state = {k: v for k, v in model.state_dict().items() if k not in tied}
    missing, unexpected = sorted(set(state) - set(saved)), sorted(set(saved) - set(state) - tied)
    if missing or unexpected:
        lora = any("lora_" in k for k in unexpected)
        hint = " (LoRA adapters: save with 'hf_model' in save_contents for the merged model)" if lora else ""
        raise CheckpointError(
            f"{dcp_dir} does not hold {config_dir}'s model{hint}: missing {missing[:4]}, unexpected {unexpected[:4]}"
        )
    # DCP reads into these tensors in place, and they share the model's parameter storage; one
    # process is the intent, which DCP would otherwise warn it assumed
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load({"model": state}, checkpoint_id=dcp_dir, no_dist=True)
    return model


def merge(local_dir: str, target_dir: str, config_dir: str | None = None) -> str:
    """Write the HF model of our checkpoint `local_dir` to `target_dir` (see the module docstring);
    returns the checkpoint folder read (`local_dir` or its newer `.tmp` / older `.old` sibling, as
    `load` picks). Raises CheckpointNotFoundError (no complete checkpoint), CheckpointError (a
    damaged one, or weights that are not `config_dir`'s model), ValueError (no export and no
    `config_dir`)."""
    from ..models import save_pretrained
    from .checkpoint import CheckpointNotFoundError, _read_marker

    folder = _our_checkpoint(local_dir)
    if folder is None:
        raise CheckpointNotFoundError(f"{local_dir}: no complete verl_moe checkpoint (no COMPLETE file)")
    _read_marker(folder)
    export = os.path.join(folder, HF_EXPORT)
    os.makedirs(target_dir, exist_ok=True)
    if os.path.isfile(os.path.join(export, "config.json")):
        shutil.copytree(export, target_dir, dirs_exist_ok=True)
    elif config_dir is None:
        raise ValueError(f"{folder} holds no {HF_EXPORT}/ export: pass --config_dir (the trained model's HF folder)")
    else:
        save_pretrained(_model_from_dcp(os.path.join(folder, "dcp"), config_dir), target_dir)
    if config_dir is not None:
        _copy_non_weights(config_dir, target_dir)
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=COMMAND.rsplit(" ", 1)[0], description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="operation", required=True)
    run = sub.add_parser("merge", help="write the checkpoint's model as an HF folder")
    run.add_argument("--local_dir", required=True, help="the checkpoint folder (<ckpt>/global_step_N/actor)")
    run.add_argument("--target_dir", required=True, help="where the HF model goes")
    run.add_argument("--config_dir", default=None, help="the trained model's HF folder (config, tokenizer)")
    args = parser.parse_args(argv)
    folder = merge(args.local_dir, args.target_dir, args.config_dir)
    print(f"verl_moe: wrote the model of {folder} to {args.target_dir}", file=sys.stderr)


if __name__ == "__main__":
    main()
