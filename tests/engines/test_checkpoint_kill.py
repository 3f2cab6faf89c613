"""A SIGKILL at any instant of `save_checkpoint` (a fresh save, an overwrite of the same path, the
pruning of an older path) never loses a checkpoint: a fresh process loads every path to exactly
one state that was saved there and may still be there, bit for bit, on 1 and 2 gloo ranks.

A saver runs SCRIPT (each step changes the weights and the LR schedule, writes the state it is
about to save as a reference file, then saves), and its whole process group is SIGKILLed
either at its k-th file-system call on a rank (fsync / rename / replace / unlink / rmdir,
counted in the saver; a clean calibration run gives the count) or after a random delay.
The expected states come from replaying the steps the saver logged as started / finished (the
independent model of `max_ckpt_to_keep`: distinct paths, newest kept). The default run kills at
a seeded sample of the calls of the overwrite and the prune step; the slow sweep kills at every
call on every rank plus random delays.
"""

from __future__ import annotations

import os
import random
import time

import pytest
import torch
from forked import shared_server
from torch.distributed.checkpoint.api import CheckpointException

MISSING = "missing"
# (path, max_ckpt_to_keep): a fresh save, an overwrite of the same path keeping one (saving one
# path twice must not delete it), a fresh path that prunes the first
SCRIPT = [("a", 1), ("a", 1), ("b", 1)]
OVERWRITE_STEP, PRUNE_STEP = 2, 3
# os.mkdir is left out: with two ranks, which one creates a shared folder (and so calls mkdir
# once more) is a race, and the counts must repeat from run to run
COUNTED = ("fsync", "rename", "replace", "unlink", "remove", "rmdir")
RENAMES_AND_DELETES = ("rename", "replace", "unlink", "remove", "rmdir")  # the calls that change what a name holds
SCHEDULE = dict(lr_warmup_steps=2, total_training_steps=10, lr_scheduler_type="cosine")


def _engine(model_path: str):
    from engine_setup import build_engine
    from verl.trainer.config import CheckpointConfig

    contents = ["model", "optimizer", "extra"]
    config = CheckpointConfig(save_contents=contents, load_contents=contents)
    return build_engine(model_path, optimizer=SCHEDULE, checkpoint_config=config)


def _state(engine) -> dict:
    gen, _ = engine.get_per_tensor_param(layout="hf")
    return {"weights": {name: t.clone() for name, t in gen}, "last_epoch": engine.lr_scheduler.last_epoch}


def _log(root: str, line: str) -> None:
    fd = os.open(os.path.join(root, "log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, (line + "\n").encode())
    os.close(fd)


class _CountedCalls:
    """Wraps the os calls that change files; kills the process group before call number `kill_at`."""

    def __init__(self, kill_at: int | None):
        self.kill_at, self.calls, self.real = kill_at, [], {name: getattr(os, name) for name in COUNTED}

    def __enter__(self):
        for name, real in self.real.items():
            setattr(os, name, self._wrap(real))
        return self

    def _wrap(self, real):
        def counted(*args, **kwargs):
            self.calls.append(real.__name__)
            if len(self.calls) == self.kill_at:
                from forked import kill_group

                kill_group()
            return real(*args, **kwargs)

        return counted

    def __exit__(self, *exc):
        for name, real in self.real.items():
            setattr(os, name, real)


def saver(rank: int, world_size: int, model_path: str, root: str, kill_at: list | None) -> dict:
    """Run SCRIPT; `kill_at` = (rank, k): that rank kills the group before its k-th counted call. Rank 0 logs
    "start|done <step> <calls so far>". Returns {"calls": the os function of each counted call,
    "seconds": of the script}."""
    engine = _engine(model_path)
    for p in engine.module.parameters():  # an Adam state to save
        p.grad = torch.zeros_like(p)
    engine.optimizer.step()
    engine.optimizer_zero_grad()
    counter = _CountedCalls(kill_at[1] if kill_at is not None and kill_at[0] == rank else None)
    if rank == 0:
        open(os.path.join(root, "ready"), "w").close()
    began = time.monotonic()
    for step, (name, keep) in enumerate(SCRIPT, start=1):
        with torch.no_grad():
            for p in engine.module.parameters():
                p.add_(0.01 * step)
        engine.lr_scheduler_step()
        state = _state(engine)
        if rank == 0:
            torch.save(state, os.path.join(root, f"ref{step}.part"))
            os.replace(os.path.join(root, f"ref{step}.part"), os.path.join(root, f"ref{step}.pt"))
            _log(root, f"start {step} {len(counter.calls)}")
        with counter:
            engine.save_checkpoint(os.path.join(root, name), global_step=step, max_ckpt_to_keep=keep)
        if rank == 0:
            _log(root, f"done {step} {len(counter.calls)}")
    return {"calls": counter.calls, "seconds": time.monotonic() - began}


def verifier(rank: int, world_size: int, model_path: str, roots: list[str]) -> list[dict]:
    """Per saver folder: {path: state index or MISSING or the error}; then a save to the path of the
    last step started, and its load, must settle the folder (only the path left, holding that state)."""
    engine = _engine(model_path)
    found = []
    for root in roots:
        refs = {
            int(f[3:-3]): torch.load(os.path.join(root, f))
            for f in os.listdir(root)
            if f.startswith("ref") and f.endswith(".pt")
        }
        got = {}
        for name in sorted({name for name, _ in SCRIPT}):
            try:
                engine.load_checkpoint(os.path.join(root, name))
            except FileNotFoundError:  # a clean refusal: no complete checkpoint there
                got[name] = MISSING
                continue
            except (Exception, CheckpointException) as e:  # DCP's is a BaseException
                got[name] = f"{type(e).__name__}: {e}"
                continue
            state = _state(engine)
            same = [
                step
                for step, ref in refs.items()
                if ref["last_epoch"] == state["last_epoch"]
                and all(torch.equal(ref["weights"][k], v) for k, v in state["weights"].items())
            ]
            got[name] = same[0] if len(same) == 1 else f"matches refs {same}"
        started = [step for kind, step, _ in _read_log(root) if kind == "start"]
        if started:
            path = os.path.join(root, SCRIPT[started[-1] - 1][0])
            expected = _state(engine)
            engine.save_checkpoint(path, global_step=99)
            engine.load_checkpoint(path)
            state = _state(engine)
            resaved = all(torch.equal(expected["weights"][k], v) for k, v in state["weights"].items())
            leftovers = [f for f in (path + ".tmp", path + ".old") if os.path.exists(f)]
            got["resave"] = "ok" if resaved and not leftovers else f"resaved={resaved} leftovers={leftovers}"
        found.append(got)
    return found


def _read_log(root: str) -> list[tuple[str, int, int]]:
    file = os.path.join(root, "log")
    lines = open(file).read().splitlines() if os.path.exists(file) else []
    return [(kind, int(step), int(calls)) for kind, step, calls in (line.split() for line in lines)]


def allowed(log: list[tuple[str, int, int]]) -> dict[str, set]:
    """Per path, the states a load may return after a kill, from the logged steps: the last finished
    save to it (unless pruned since), plus the step in flight (to its path) or MISSING (for the paths
    that step prunes). `max_ckpt_to_keep` keeps the newest distinct paths."""
    done = [step for kind, step, _ in log if kind == "done"]
    started = [step for kind, step, _ in log if kind == "start"]
    kept: list[str] = []
    state = {name: MISSING for name, _ in SCRIPT}
    out = {name: set() for name in state}

    def save(step, name, keep):
        nonlocal kept
        kept = [p for p in kept if p != name] + [name]
        pruned = kept[:-keep]
        kept = kept[-keep:]
        return pruned

    for step in done:
        name, keep = SCRIPT[step - 1]
        state[name] = step
        for p in save(step, name, keep):
            state[p] = MISSING
    for name in state:
        out[name].add(state[name])
    in_flight = [s for s in started if s not in done]
    if in_flight:
        name, keep = SCRIPT[in_flight[0] - 1]
        out[name].add(in_flight[0])
        for p in save(in_flight[0], name, keep):
            out[p].add(MISSING)
    return out


def _check(root: str, got: dict) -> None:
    log = _read_log(root)
    expect = allowed(log)
    for name, states in expect.items():
        assert got[name] in states, f"{root}: {name} loaded {got[name]!r}, allowed {states} (log {log})"
    if "resave" in got:
        assert got["resave"] == "ok", f"{root}: {got['resave']}"


def _saved(server, model_path: str, root: str, world_size: int, kill_at=None, kill_after=None) -> dict:
    """One saver run into a fresh `root`: its results when every rank finished, else {} (it was killed)."""
    os.makedirs(root)
    outcome = server.run(__name__, "saver", world_size, model_path, root, kill_at, timeout=120, kill_after=kill_after)
    assert not outcome.errors and not outcome.timed_out, outcome
    finished = len(outcome.results) == world_size
    if kill_at is not None:
        assert outcome.killed and not finished, outcome
    elif kill_after is None:
        assert not outcome.killed and finished, outcome
    # after a random delay the kill may also land once the work is done (in the ranks' teardown, or
    # between the ranks' last writes): what the folder holds is checked against the log either way
    return outcome.results if finished else {}


def _sweep(tmp_path, world_size: int, pick_calls, delays: int = 0) -> None:
    """A clean run (it gives rank 0's calls per step, from its log), then runs killed at the calls
    `pick_calls(calls, steps)` returns as (rank, k) or after `delays` random delays, then one
    fresh verifier over all of them."""
    from engine_setup import write_tiny_model

    server = shared_server()
    model_path = write_tiny_model(str(tmp_path / "model"))
    clean = str(tmp_path / f"w{world_size}-clean")
    results = _saved(server, model_path, clean, world_size)
    calls = [results[r]["calls"] for r in sorted(results)]
    marks = {(kind, step): calls for kind, step, calls in _read_log(clean)}
    steps = {step: range(marks["start", step] + 1, marks["done", step] + 1) for step in range(1, len(SCRIPT) + 1)}
    roots = [clean]
    for rank, call in pick_calls(calls, steps):
        roots.append(str(tmp_path / f"w{world_size}-rank{rank}-call{call}"))
        _saved(server, model_path, roots[-1], world_size, kill_at=(rank, call))
    for i in range(delays):
        roots.append(str(tmp_path / f"w{world_size}-delay{i}"))
        kill_after = (os.path.join(roots[-1], "ready"), random.uniform(0.0, results[0]["seconds"]))
        _saved(server, model_path, roots[-1], world_size, kill_after=kill_after)
    found = server.run(__name__, "verifier", world_size, model_path, roots, timeout=300).check()[0]
    assert found[0] == {"a": MISSING, "b": len(SCRIPT), "resave": "ok"}, found[0]
    for root, got in zip(roots, found, strict=True):
        _check(root, got)


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [1, 2])
def test_kill_during_overwrite_and_prune(tmp_path, world_size):
    """Rank 0 killed at a seeded sample of the renames and deletions of the overwrite and of the
    prune step (the calls between writes only extend an unfinished folder)."""

    def pick(calls, steps):
        rng = random.Random(world_size)
        picked = []
        for step, count in ((OVERWRITE_STEP, 2), (PRUNE_STEP, 2 if world_size == 1 else 1)):
            changes = [k for k in steps[step] if calls[0][k - 1] in RENAMES_AND_DELETES]
            picked += rng.sample(changes, count)
        return [(0, k) for k in sorted(picked)]

    _sweep(tmp_path, world_size, pick)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_kill_at_every_call_and_random_delays(tmp_path, world_size):
    def every(calls, steps):
        return [(rank, k) for rank, rank_calls in enumerate(calls) for k in range(1, len(rank_calls) + 1)]

    _sweep(tmp_path, world_size, every, delays=15)
