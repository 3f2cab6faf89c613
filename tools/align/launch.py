"""Where a backend runs: in the align process (a backend with `launched=False`, the reference) or
as `world_size` torchrun ranks of this module (`python -m torch.distributed.run ... -m
verl_moe.tools.align.launch JOB.json`), whose rank 0 saves the trace the parent then loads."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .backends import parse_backend
from .job import Job, release_device_memory
from .trace import BackendTrace, load_trace

STEP_MARK = "ALIGN_STEP "  # a worker prints it with the steps done; the parent's progress bar reads it


def run_backend(job: Job, log_dir: Path, progress: Callable[[int], None] | None = None) -> BackendTrace:
    """Run one backend, in this process or under torchrun; its trace is also saved at `job.trace_path`."""
    spec = parse_backend(job.backend)
    if not spec.backend.launched:
        trace = spec.backend.run(job, spec, progress)
        torch.save(trace, job.trace_path)
        release_device_memory()  # the workers launched next need the accelerator memory it cached
        return trace
    return _launch(job, log_dir, progress)


def _launch(job: Job, log_dir: Path, progress: Callable[[int], None] | None) -> BackendTrace:
    """torchrun the worker below; stream its log, advance `progress` on its step lines."""
    log_dir.mkdir(parents=True, exist_ok=True)
    spec = parse_backend(job.backend)
    job_path = log_dir / f"{Path(job.trace_path).stem}.job.json"
    job.dump(job_path)
    log_path = log_dir / f"{Path(job.trace_path).stem}.log"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={job.world_size}",
        "-m",
        "verl_moe.tools.align.launch",
        str(job_path),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for line in proc.stdout:
            log.write(line)
            if line.startswith(STEP_MARK) and progress:
                progress(int(line[len(STEP_MARK) :].split()[0]))
        code = proc.wait()
    if code != 0:
        errors = [ln for ln in log_path.read_text().splitlines() if re.match(r"^[\w.]+(Error|Exception)\b", ln)]
        cause = errors[0] if errors else "see the log"
        raise RuntimeError(f"{spec.label}: worker exited with {code}: {cause} (log {log_path})")
    return load_trace(job.trace_path)


def worker_main(job_path: str) -> None:
    """One torchrun rank: run the job's backend; rank 0 saves the trace."""
    job = Job.load(job_path)
    spec = parse_backend(job.backend)
    if not spec.backend.launched:
        raise ValueError(f"backend {spec.name} has no distributed worker")
    start = time.perf_counter()

    def mark(k: int) -> None:  # the parent's progress bar reads k; the log keeps the seconds since start
        print(f"{STEP_MARK}{k} {time.perf_counter() - start:.1f}s", flush=True)

    trace = spec.backend.run(job, spec, mark)
    if trace is not None:  # rank 0
        torch.save(trace, job.trace_path)


if __name__ == "__main__":  # torchrun ... -m verl_moe.tools.align.launch JOB.json
    worker_main(sys.argv[1])
