"""A benchmark's child process in a v1 memory cgroup of its own, on a cold page cache: what it read, its peak RSS and
the cgroup's peak charge, failcnt and OOM kills (benchmarks/lookahead_bench_arms.py and released_disk_bench.py run
every arm, ours and llama.cpp's, through it). Needs root: cgroup v1 at /sys/fs/cgroup/memory, drop_caches."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("1\n")


def run_limited(cmd: list[str], limit_bytes: int | None, name: str, log: Path, timeout_s: float = 900) -> dict:
    """Run cmd in a fresh v1 memory cgroup of limit_bytes (None: no limit, no cgroup) after dropping the page cache:
    its exit code, stdout, rusage (read bytes, max RSS) and the cgroup's peak charge, failcnt and OOM kills."""
    cg = CGROUP_ROOT / f"lookahead-bench-{name}"
    if limit_bytes is not None:
        if cg.exists():
            cg.rmdir()
        cg.mkdir()
        (cg / "memory.limit_in_bytes").write_text(str(limit_bytes))
    drop_caches()
    procs = str(cg / "cgroup.procs")

    def join():     # in the child, before exec: everything it maps or reads is charged to the cgroup
        with open(procs, "w") as f:
            f.write(str(os.getpid()))

    start = time.perf_counter()
    with open(log, "w") as out, open(log.with_suffix(".err"), "w") as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err, preexec_fn=join if limit_bytes is not None else None)
        deadline = start + timeout_s
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                p.kill()
            time.sleep(0.05)
    p.returncode = os.waitstatus_to_exitcode(status)
    res = {"rc": p.returncode, "wall_s": time.perf_counter() - start, "stdout": log.read_text(),
           "stderr_tail": log.with_suffix(".err").read_text()[-3000:],
           "child_read_bytes": ru.ru_inblock * 512, "child_maxrss_bytes": ru.ru_maxrss * 1024}
    if limit_bytes is not None:
        oom = dict(line.split() for line in (cg / "memory.oom_control").read_text().splitlines())
        res.update(cgroup_limit_bytes=limit_bytes, cgroup_max_usage_bytes=int((cg / "memory.max_usage_in_bytes").read_text()),
                   cgroup_failcnt=int((cg / "memory.failcnt").read_text()), cgroup_oom_kills=int(oom.get("oom_kill", 0)))
        cg.rmdir()
    return res
