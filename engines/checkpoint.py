"""Checkpoints for our FSDP2 engines: plain functions over sharded modules.

Layout of a checkpoint folder `<path>/`:
    dcp/                    torch.distributed.checkpoint of {"model": ..., "optimizer": ...}
                            (sharded state dicts; any rank count can read it back)
    extra_rank{r}.pt        per rank: LR scheduler state, RNG states (torch, device, python,
                            numpy), global step, as tensors / ints / lists (read with
                            `torch.load(weights_only=True)`); resume needs the same world size
    huggingface/            optional: config.json + safetensors, loadable by transformers
    COMPLETE                JSON (format, global step, world size, contents), written last

A folder is a checkpoint only when it holds COMPLETE: rank 0 writes it (to a temporary name,
fsynced, renamed) after every rank finished writing, and removes it first when a folder is
deleted, so a folder with COMPLETE is whole. A save writes `<path>.tmp/`, then renames
`<path>` (if any) to `<path>.old`, `<path>.tmp` to `<path>`, and deletes `<path>.old`. A kill at
any instant leaves a complete folder among `<path>.tmp` (newest), `<path>`, `<path>.old`
(oldest) whenever one existed before; `load` reads the newest complete one and the next save to
`<path>` first finishes the interrupted one's renames. Pruning deletes `.old`, the folder, then
`.tmp`, so a pruned path loads its last state or nothing, never an older one.

Trust: torch.distributed.checkpoint unpickles `dcp/.metadata`, so a checkpoint folder must come
from a trusted source, as for any torch checkpoint.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from verl_moe.ops import device

logger = logging.getLogger(__name__)

TMP_SUFFIX = ".tmp"
OLD_SUFFIX = ".old"
COMPLETE = "COMPLETE"
FORMAT = 1
CONTENTS = ("model", "optimizer", "extra", "hf_model")


def checkpoint_contents(checkpoint_config, which: str) -> tuple[str, ...]:
    """`save_contents` / `load_contents` of verl's CheckpointConfig (all but hf_model when None)."""
    if checkpoint_config is None:
        return ("model", "optimizer", "extra")
    contents = tuple(getattr(checkpoint_config, f"{which}_contents"))
    unknown = set(contents) - set(CONTENTS)
    if unknown:
        raise ValueError(f"{which}_contents has unknown entries {sorted(unknown)}; choices: {CONTENTS}")
    if "model" not in contents:
        raise ValueError(f"{which}_contents must include 'model'")
    return contents


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded: incomplete, damaged, or saved for another job."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No complete checkpoint at a path, or a file it needs is missing."""


def _fsync_dir(folder: str) -> None:
    """Make renames / deletions inside `folder` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(file: str) -> None:
    with open(file, "rb") as f:
        os.fsync(f.fileno())


def _fsync_tree(folder: str) -> None:
    for root, _, files in os.walk(folder):
        for name in files:
            _fsync_file(os.path.join(root, name))
        _fsync_dir(root)


def _is_complete(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, COMPLETE))


def _discard(folder: str) -> None:
    """Delete a checkpoint folder, COMPLETE first, so a kill midway never leaves a whole-looking one."""
    if not os.path.lexists(folder):
        return
    marker = os.path.join(folder, COMPLETE)
    if os.path.isfile(marker):
        os.remove(marker)
        _fsync_dir(folder)
    shutil.rmtree(folder)


def _newest_complete(path: str) -> str | None:
    """The folder `load` reads for `path`: the newest complete one of `.tmp`, itself, `.old`."""
    for folder in (path + TMP_SUFFIX, path, path + OLD_SUFFIX):
        if _is_complete(folder):
            return folder
    return None


def _promote(path: str) -> None:
    """Rename a complete `<path>.tmp` to `<path>` (rank 0); each step keeps a complete folder."""
    parent = os.path.dirname(path)
    old = path + OLD_SUFFIX
    _discard(old)  # older than <path>, and os.replace needs the name free
    if os.path.lexists(path):
        os.replace(path, old)
        _fsync_dir(parent)
    os.replace(path + TMP_SUFFIX, path)
    _fsync_dir(parent)
    _discard(old)


def _settle(path: str) -> None:
    """Before a save (rank 0): finish an interrupted save to `path` as `load` would read it, then
    clear the leftovers, so only `<path>` (complete) or nothing remains."""
    newest = _newest_complete(path)
    if newest == path + TMP_SUFFIX:
        _promote(path)
    elif newest == path + OLD_SUFFIX:
        _discard(path)
        os.replace(newest, path)
        _fsync_dir(os.path.dirname(path))
    _discard(path + OLD_SUFFIX)
    _discard(path + TMP_SUFFIX)
    if not _is_complete(path):
        _discard(path)


def discard_checkpoint(path: str) -> None:
    """Delete the checkpoint at `path` (rank 0), oldest folder first (see the module docstring)."""
    path = os.path.abspath(path)
    for folder in (path + OLD_SUFFIX, path, path + TMP_SUFFIX):
        _discard(folder)


def _rng_state() -> dict:
    """RNG states as `torch.load(weights_only=True)` reads them (tensors, ints, floats, tuples)."""
    _, key, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {"key": torch.from_numpy(key.astype(np.int64)), "pos": pos, "has_gauss": has_gauss, "gauss": gauss},
    }
    if device.is_accelerator():
        state["device"] = device.device_module().get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    numpy = state["numpy"]
    key = numpy["key"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", key, numpy["pos"], numpy["has_gauss"], numpy["gauss"]))
    if device.is_accelerator():
        device.device_module().set_rng_state(state["device"])


def _extra_bytes(extra: dict) -> bytes:
    """`extra` serialized; refused here, at save, when `weights_only` loading could not read it back."""
    buffer = io.BytesIO()
    torch.save(extra, buffer)
    try:
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(f"LR scheduler state: a type torch.load(weights_only=True) refuses ({_first_line(e)})") from e
    return buffer.getvalue()


def _export_hf(model: nn.Module, path: str) -> None:
    """Gather full tensors; rank 0 loads them into an unsharded copy of the spec and writes HF files
    (LoRA adapters merged into their base weights: an HF model, as verl's merged export; a critic's value
    model as a token classifier, `models/value_head.py`)."""
    from verl_moe.models import build, lora, save_pretrained
    from verl_moe.models.value_head import add_value_head, is_value_model, save_value_pretrained

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        full = lora.merged_state_dict(model, full)
        dtype = next(iter(full.values())).dtype
        copy = build(model.config, dtype=dtype, device="meta")
        value = is_value_model(model)
        if value:
            add_value_head(copy)
        copy.to_empty(device="cpu")
        copy.load_state_dict(full, strict=not model.arch.tie_word_embeddings)
        if model.arch.tie_word_embeddings:
            copy.lm_head.weight = copy.model.embed_tokens.weight
        (save_value_pretrained if value else save_pretrained)(copy, path)


def _write_marker(folder: str, marker: dict) -> None:
    """COMPLETE, atomically: a temporary name, fsynced, renamed, the folder fsynced."""
    file = os.path.join(folder, COMPLETE)
    with open(file + ".part", "w") as f:
        json.dump(marker, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(file + ".part", file)
    _fsync_dir(folder)


def _first_line(error: BaseException) -> str:
    """`Type: first line` of an error; for DCP's CheckpointException, of the first rank's cause."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (cause, _) = next(iter(sorted(error.failures.items(), key=lambda item: item[0])))
        return f"rank {rank}: {_first_line(cause)}"
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def _agree(problem: BaseException | None, what: str, token=None) -> None:
    """Every rank raises when any rank has a problem, or when the ranks' `token`s differ: one
    CheckpointError (CheckpointNotFoundError for a missing file) naming the first failing rank."""
    reports = [None] * dist.get_world_size()
    message = None
    if problem is not None:
        message = str(problem) if isinstance(problem, CheckpointError) else _first_line(problem)
    dist.all_gather_object(reports, (message, isinstance(problem, FileNotFoundError), token))
    failed = [(rank, m, missing) for rank, (m, missing, _) in enumerate(reports) if m is not None]
    if failed:
        rank, message, missing = failed[0]
        more = f" and {len(failed) - 1} more" if len(failed) > 1 else ""
        raise (CheckpointNotFoundError if missing else CheckpointError)(f"{what}: {message} (rank {rank}{more})")
    if any(t != reports[0][2] for _, _, t in reports):
        raise CheckpointError(f"{what}: the ranks see different folders {sorted({str(r[2]) for r in reports})}")


def save(path: str, *, model: nn.Module, optimizer, lr_scheduler, global_step: int, hf_export: bool) -> str:
    """Write the checkpoint folder `path` (see the module docstring); a kill at any instant keeps
    the previous checkpoint at `path` (if any) or this one loadable. Returns `path` made absolute.

    Raises CheckpointError on every rank when a rank fails to write its part (`path` keeps its
    previous checkpoint), ValueError when the LR scheduler state is not plain data.
    """
    path = os.path.abspath(path)
    tmp = path + TMP_SUFFIX
    rank, world_size = dist.get_rank(), dist.get_world_size()
    what = f"checkpoint save to {path}"
    problem = None
    if rank == 0:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            _settle(path)
        except OSError as e:
            problem = e
    _agree(problem, what)
    contents = ["model"]
    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
    else:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        contents.append("optimizer")
    try:
        dcp.save(state, checkpoint_id=os.path.join(tmp, "dcp"))
    except CheckpointException as e:  # raised on every rank
        raise CheckpointError(f"{what}: torch.distributed.checkpoint failed ({_first_line(e)})") from e
    extra = {"global_step": global_step, "rng": _rng_state(), "world_size": world_size}
    if lr_scheduler is not None:
        extra["lr_scheduler"] = lr_scheduler.state_dict()
        contents.append("extra")
    try:
        data = _extra_bytes(extra)
        with open(os.path.join(tmp, f"extra_rank{rank}.pt"), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except (OSError, ValueError) as e:
        problem = e
    _agree(problem, what)
    if hf_export:  # after the agreement: every rank must enter its gather
        try:
            _export_hf(model, os.path.join(tmp, "huggingface"))
            contents.append("hf_model")
        except (OSError, ValueError) as e:
            problem = e
        _agree(problem, what)
    if rank == 0:
        try:
            _fsync_tree(tmp)
            marker = {"format": FORMAT, "global_step": global_step, "world_size": world_size, "contents": contents}
            _write_marker(tmp, marker)
            _promote(path)
        except OSError as e:
            problem = e
    _agree(problem, what)
    return path


def _read_marker(folder: str) -> dict:
    file = os.path.join(folder, COMPLETE)
    try:
        with open(file) as f:
            marker = json.load(f)
        if marker["format"] != FORMAT:
            raise ValueError(f"format {marker['format']}, this verl_moe reads format {FORMAT}")
        int(marker["world_size"]), list(marker["contents"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{file} is damaged ({_first_line(e)})") from e
    return marker


def _check_dcp(dcp_dir: str) -> None:
    """Every shard file the DCP metadata names exists and is long enough (checked before anything is read)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata_file = os.path.join(dcp_dir, ".metadata")
    if not os.path.isfile(metadata_file):
        raise CheckpointNotFoundError(f"{metadata_file} missing")
    try:
        metadata = FileSystemReader(dcp_dir).read_metadata()
        ends: dict[str, int] = {}
        for info in metadata.storage_data.values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    except Exception as e:  # an unpickling failure can raise almost anything
        raise CheckpointError(f"{metadata_file} is damaged ({_first_line(e)})") from e
    for name, end in sorted(ends.items()):
        file = os.path.join(dcp_dir, name)
        if not os.path.isfile(file):
            raise CheckpointNotFoundError(f"{file} missing")
        if os.path.getsize(file) < end:
            raise CheckpointError(f"{file} is truncated: {os.path.getsize(file)} bytes, the metadata needs {end}")


def _read_extra(folder: str, marker: dict) -> dict:
    """This rank's LR scheduler / RNG state, read as plain data (`weights_only=True`: no code runs)."""
    world_size = dist.get_world_size()
    if "extra" not in marker["contents"]:
        raise CheckpointError(f"{folder} holds no LR scheduler / RNG state (saved without 'extra')")
    if marker["world_size"] != world_size:
        raise CheckpointError(
            f"{folder} was saved by {marker['world_size']} ranks, this job has {world_size}: per-rank LR "
            "scheduler / RNG state needs the same world size (leave 'extra' out of load_contents)"
        )
    file = os.path.join(folder, f"extra_rank{dist.get_rank()}.pt")
    if not os.path.isfile(file):
        raise CheckpointNotFoundError(f"{file} missing")
    try:
        extra = torch.load(file, weights_only=True)
        extra["lr_scheduler"], extra["rng"]["torch"]
    except Exception as e:  # torch.load of a damaged or hostile file: unpickling, zip or key errors
        raise CheckpointError(f"{file} is damaged or not plain data ({_first_line(e)})") from e
    return extra


def load(path: str, *, model: nn.Module, optimizer, lr_scheduler) -> None:
    """Restore model (and optimizer / LR scheduler / RNG when given) from `save`'s folder, the
    newest complete one (see the module docstring). Every rank checks the files it needs first,
    and all raise together, before anything is restored, when one rank finds a problem.

    Raises CheckpointNotFoundError (a FileNotFoundError) for a missing checkpoint or file,
    CheckpointError (a ValueError) for a damaged file, a world-size change with per-rank state
    requested, or contents the folder does not hold.
    """
    path = os.path.abspath(path)
    what = f"checkpoint {path}"
    folder, extra, problem = _newest_complete(path), None, None
    try:
        if folder is None:
            raise CheckpointNotFoundError(
                f"no complete checkpoint (no {COMPLETE} file in it, nor in its {TMP_SUFFIX} or {OLD_SUFFIX})"
            )
        marker = _read_marker(folder)
        if optimizer is not None and "optimizer" not in marker["contents"]:
            raise CheckpointError(f"{folder} holds no optimizer state (saved without 'optimizer')")
        _check_dcp(os.path.join(folder, "dcp"))
        if lr_scheduler is not None:
            extra = _read_extra(folder, marker)
    except CheckpointError as e:
        problem = e
    _agree(problem, what, token=folder)
    dcp_dir = os.path.join(folder, "dcp")
    try:
        if optimizer is None:
            state = {"model": get_model_state_dict(model)}
            dcp.load(state, checkpoint_id=dcp_dir)
            set_model_state_dict(model, state["model"])
        else:
            model_state, optim_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optimizer": optim_state}
            dcp.load(state, checkpoint_id=dcp_dir)
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    except (CheckpointException, OSError) as e:  # DCP raises CheckpointException on every rank
        raise CheckpointError(f"{what}: torch.distributed.checkpoint failed on {dcp_dir} ({_first_line(e)})") from e
    if extra is not None:
        lr_scheduler.load_state_dict(extra["lr_scheduler"])
        _set_rng_state(extra["rng"])


def prune(paths: list[str], keep: int) -> list[str]:
    """Delete all but the newest `keep` distinct checkpoint paths (rank 0; a failure to delete is
    logged, not raised); returns the kept paths, oldest first. The last path is always kept."""
    distinct = list(dict.fromkeys(os.path.abspath(p) for p in reversed(paths)))[::-1]
    if keep <= 0:
        return distinct
    if dist.get_rank() == 0:
        for old in distinct[:-keep]:
            try:
                discard_checkpoint(old)
            except OSError as e:
                logger.warning("verl_moe: could not delete old checkpoint %s: %s", old, e)
    dist.barrier()
    return distinct[-keep:]
