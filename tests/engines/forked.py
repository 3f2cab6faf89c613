"""A fork server for gloo rank tests that must start many fresh process groups cheaply.

`tests/dist.py::spawn` starts fresh interpreters: each pays the ~10 s import of torch, verl and
verl_moe. Tests that kill savers at many points, or run many short checks, fork their ranks
instead from one server process that imported all of that once and never ran a collective.
The ranks of one call form a process group of their own (`os.killpg` kills all of them, as a
job scheduler would), join a fresh gloo group, run `module.fn(rank, world_size, *args)` and
exit with `os._exit`. A rank's return value (JSON) and traceback come back per rank.

    ranks = shared_server()
    outcome = ranks.run("test_module", "fn", 2, arg, timeout=60)
    outcome.check()  # raises with the first rank's traceback

Kill points: `kill_after=(ready_file, seconds)` makes the server SIGKILL the group `seconds`
after `ready_file` appears; a rank may also kill its own group (`kill_group`).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
PRELOAD = ("pytest", "torch.distributed.checkpoint", "engine_setup", "verl_moe.engines.fsdp2", "verl.trainer.config")


@dataclass
class Outcome:
    """What one call's ranks did: `results[r]` (the return value of rank r, None if it died),
    `errors[r]` (traceback text), `killed` (SIGKILLed by a kill point), `timed_out`."""

    results: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)
    killed: bool = False
    timed_out: bool = False

    def check(self) -> list:
        """The per-rank results in rank order; AssertionError when a rank failed, was killed or hung."""
        if self.timed_out:
            raise AssertionError(f"ranks did not finish in time (stuck; errors so far: {self.errors})")
        if self.errors:
            rank = min(self.errors)
            raise AssertionError(f"rank {rank} failed:\n{self.errors[rank]}")
        if self.killed:
            raise AssertionError("ranks were killed")
        return [self.results[r] for r in sorted(self.results)]


def kill_group() -> None:
    """SIGKILL every rank of this call (from inside a rank)."""
    os.killpg(0, signal.SIGKILL)


class Server:
    """Client side: a subprocess running `serve()`, fed one JSON request per line."""

    def __init__(self):
        env = dict(os.environ, VERL_PLATFORM="cpu", OMP_NUM_THREADS="1", RAY_AUTH_MODE="disabled")
        env["PYTHONPATH"] = os.pathsep.join([HERE, os.path.dirname(HERE), env.get("PYTHONPATH", "")])
        code = "import forked; forked.serve()"
        self.process = subprocess.Popen(
            [sys.executable, "-W", "ignore", "-c", code],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        if self.process.stdout.readline().strip() != "ready":
            raise RuntimeError("fork server failed to start (see stderr)")

    def run(self, module: str, fn: str, world_size: int, *args, timeout: float = 120, kill_after=None) -> Outcome:
        request = dict(module=module, fn=fn, world_size=world_size, args=args, timeout=timeout, kill_after=kill_after)
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("fork server died (see stderr)")
        reply = json.loads(line)
        return Outcome(
            results={int(r): v for r, v in reply["results"].items()},
            errors={int(r): v for r, v in reply["errors"].items()},
            killed=reply["killed"],
            timed_out=reply["timed_out"],
        )

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=30)


_SHARED: Server | None = None


def shared_server() -> Server:
    """One server per pytest process, started at first use, stopped at exit."""
    global _SHARED
    if _SHARED is None or _SHARED.process.poll() is not None:
        _SHARED = Server()
        atexit.register(_SHARED.close)
    return _SHARED


# ---- server side ------------------------------------------------------------------------------


def _rank_main(rank: int, request: dict, port: int, out: str) -> None:
    import importlib

    import torch
    import torch.distributed as dist

    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=request["world_size"],
            timeout=timedelta(seconds=request["timeout"]),
        )
        torch.manual_seed(0)
        fn = getattr(importlib.import_module(request["module"]), request["fn"])
        result = fn(rank, request["world_size"], *request["args"])
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def _serve_one(request: dict) -> dict:
    from dist import free_port

    out = tempfile.mkdtemp(prefix="forked-")
    port, pids = free_port(), []
    for rank in range(request["world_size"]):
        leader = pids[0] if pids else 0
        pid = os.fork()
        if pid == 0:
            os.setpgid(0, leader)
            _rank_main(rank, request, port, out)
        os.setpgid(pid, leader or pid)  # also here: no race with the child's own call
        pids.append(pid)
    deadline = time.monotonic() + request["timeout"]
    kill_after, kill_at, killed, timed_out = request["kill_after"], None, False, False
    status = {}
    while len(status) < len(pids):
        for pid in pids:
            if pid not in status:
                done, code = os.waitpid(pid, os.WNOHANG)
                if done:
                    status[pid] = code
        if kill_after is not None and kill_at is None and os.path.exists(kill_after[0]):
            kill_at = time.monotonic() + kill_after[1]
        now = time.monotonic()
        if len(status) < len(pids) and (now > deadline or (kill_at is not None and now >= kill_at)):
            timed_out = now > deadline
            killed = killed or not timed_out
            os.killpg(pids[0], signal.SIGKILL)
            kill_at = float("inf")
        time.sleep(0.002)
    sigkilled = any(os.WIFSIGNALED(code) and os.WTERMSIG(code) == signal.SIGKILL for code in status.values())
    killed = not timed_out and (killed or sigkilled)
    results, errors = {}, {}
    for rank in range(len(pids)):
        base = os.path.join(out, f"rank{rank}")
        if os.path.exists(base + ".json"):
            with open(base + ".json") as f:
                results[rank] = json.load(f)
        if os.path.exists(base + ".err"):
            with open(base + ".err") as f:
                errors[rank] = f.read()
        elif rank not in results and not killed and not timed_out:
            errors[rank] = f"rank {rank} exited with status {status[pids[rank]]} and no traceback"
    return dict(results=results, errors=errors, killed=killed, timed_out=timed_out)


def serve() -> None:
    """Import the heavy modules once, then fork the ranks of each request read from stdin."""
    import importlib

    import torch

    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # imports' and ranks' prints go to stderr, never into the protocol
    torch.set_num_threads(1)
    for name in PRELOAD:
        importlib.import_module(name)
    protocol.write("ready\n")
    protocol.flush()
    for line in sys.stdin:
        reply = _serve_one(json.loads(line))
        protocol.write(json.dumps(reply) + "\n")
        protocol.flush()
