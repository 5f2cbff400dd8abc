"""The memory a moe-offload process takes before any weight: the interpreter, torch, transformers, the CPU kernels,
a model's code. On a CPU-only machine `--device-memory X` bounds the whole process, so the plan takes this out of X
beside the reserve (planner.plan's `runtime_bytes`); measured here, not guessed.

Measured once per installation in a fresh subprocess (about three seconds): its resident set after importing torch,
transformers and moe_offload, loading the kernels and building a small model of the family's code path, plus the
C heap's slack. Cached in `~/.cache/moe-offload/process-memory.json` (`MOE_OFFLOAD_PROCESS_MEMORY` moves it), keyed
by the Python, torch and transformers versions; a damaged cache is measured over.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

from ..kernels.host_rates import read_cache, write_cache
from .clib import libc_function

_PROBE = r"""
import torch, transformers, moe_offload
from moe_offload.kernels import KernelUnavailable, kernels
try:
    kernels()
except KernelUnavailable:
    pass
from moe_offload.tiny.make import make_tiny
import tempfile, pathlib
with tempfile.TemporaryDirectory() as d:
    folder = make_tiny(pathlib.Path(d) / "m", family="qwen3_moe", layers=1, experts=4, top_k=2, hidden=32)
    with moe_offload.load(folder, device="cpu", offload_gb=0) as loaded:
        loaded.model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)
status = open("/proc/self/status").read()
print(int(status.split("VmHWM:")[1].split()[0]) * 1024)
"""


def cache_path() -> Path:
    given = os.environ.get("MOE_OFFLOAD_PROCESS_MEMORY")
    return Path(given) if given else Path.home() / ".cache" / "moe-offload" / "process-memory.json"


def _key() -> str:
    import torch
    import transformers

    return f"python {platform.python_version()} | torch {torch.__version__} | transformers {transformers.__version__}"


def runtime_bytes(progress=None) -> int:
    """The peak resident bytes of a moe-offload process around a tiny model (its weights a few KiB): what every run
    takes beside its weights, caches and buffers. Measured once per installation, cached."""
    key, path = _key(), cache_path()
    known = read_cache(path)
    if isinstance(known.get(key), int):
        return known[key]
    if progress is not None:
        progress(f"measuring what a moe-offload process takes beside its weights (once: cached in {path})")
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode != 0:
        from ..errors import MoeOffloadError

        raise MoeOffloadError(f"measuring the process's own memory failed ({out.stderr.strip()[-300:]}); give "
                              "--reserve-gb with room for the interpreter and torch (about 0.5 GiB) instead")
    known[key] = int(out.stdout.strip().splitlines()[-1])
    write_cache(path, known)
    return known[key]


def planned_runtime_bytes(cpu_only: bool, device_memory_gb) -> int:
    """What a plan takes as the process's own memory: measured (said on stderr the first time) for a CPU-only plan
    bounded by device_memory_gb, else 0 (on an accelerator device memory is not the process's)."""
    if not cpu_only or device_memory_gb is None:
        return 0
    return runtime_bytes(progress=lambda line: print(line, file=sys.stderr, flush=True))


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3     # glibc's mallopt parameters
HEAP_MMAP_THRESHOLD = 1 << 20   # bytes: allocations from here up are mapped, and unmapped when freed


def return_freed_buffers() -> bool:
    """Have the C heap give freed large buffers back to the system at once (glibc: mmap and trim thresholds of 1 MiB).

    By default glibc raises its mmap threshold to the size of each mapped buffer freed, up to 32 MiB, so that a
    prefill's staging and dequantization buffers, once freed, are refilled from the heap and their pages stay in
    the process (measured on gpt-oss-20b's layer x 12 at a 2.62 GiB cap: 0.24 GiB more peak resident set, enough for
    the cgroup to kill it).
    Every load on a cpu device (RAM is its memory bound) calls this: a process-wide allocator setting (setting it
    again changes nothing) that changes no result. False where there is no glibc."""
    mallopt = libc_function("mallopt") if platform.system() == "Linux" else None
    if mallopt is None:
        return False
    # and the heap's free top goes back from 1 MiB (default: 128 KiB, raised with the mmap threshold)
    return bool(mallopt(M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, HEAP_MMAP_THRESHOLD))
