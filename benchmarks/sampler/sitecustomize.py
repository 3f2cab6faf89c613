"""A stack sampler for every Python process of a device run (put this folder on PYTHONPATH and set
VERL_MOE_SAMPLE_DIR): a daemon thread records the innermost frames of every thread each 20 ms and
rewrites DIR/<pid>.txt every 5 s with the most frequent stacks, so processes that Ray or a timeout
kills still leave what they were doing. No dependencies (py-spy needs ptrace)."""

import collections
import os
import sys
import threading
import time
import traceback

_DIR = os.environ.get("VERL_MOE_SAMPLE_DIR")


def _sampler(out_dir: str) -> None:
    me = threading.get_ident()
    counts: collections.Counter = collections.Counter()
    last = time.monotonic()
    while True:
        time.sleep(0.02)
        for tid, frame in sys._current_frames().items():
            if tid == me:
                continue
            stack = traceback.extract_stack(frame)[-12:]
            if not stack or stack[-1].name in ("wait", "select", "poll", "_worker", "sleep", "get", "accept", "epoll"):
                continue  # idle threads
            counts[tuple(f"{'/'.join(f.filename.rsplit('/', 2)[-2:])}:{f.lineno} {f.name}" for f in stack)] += 1
        if time.monotonic() - last > 5 and counts:
            last = time.monotonic()
            total = sum(counts.values())
            lines = [f"pid {os.getpid()} argv {' '.join(sys.argv)[:200]} samples {total}"]
            for stack, n in counts.most_common(15):
                lines.append(f"\n{n} ({100 * n / total:.1f}%)")
                lines.extend("    " + s for s in stack)
            with open(os.path.join(out_dir, f"{os.getpid()}.txt"), "w") as f:
                f.write("\n".join(lines) + "\n")


if _DIR:
    os.makedirs(_DIR, exist_ok=True)
    threading.Thread(target=_sampler, args=(_DIR,), daemon=True, name="verl_moe_sampler").start()
