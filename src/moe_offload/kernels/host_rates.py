"""The host's rates as the experts kernels see them, measured once per machine and thread count: the read bandwidth
(bytes of expert stacks per second, one row per expert: a decode step) and the FLOP rate (many rows per expert: a
prefill). The cost model (planning/cost_model.py) weighs host compute with them.

Measured in about two seconds with the kernels on bf16 stacks (256 MiB read, larger than any CPU's last-level
cache), best of three, and cached in `~/.cache/moe-offload/host-rates.json` (`MOE_OFFLOAD_HOST_RATES` moves it),
keyed by the CPU's model name, the kernels' instruction-set path and torch's thread count; `measure(again=True)`
measures anew. Given rates (`--host-gbps`, `--host-gflops`) are used as they are, without measuring.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .gemv import best_isa, expert_gemv

READ_BYTES = 256 << 20          # the stacks read by the bandwidth measurement
_K, _O = 2048, 1024             # one expert matrix: [O, K] bf16 (4 MiB)


@dataclass(frozen=True)
class HostRates:
    bytes_per_s: float
    flops_per_s: float
    key: str                    # what they were measured on (cpu, isa, threads)
    measured: bool              # measured now (False: read from the cache, or given)


def cache_path() -> Path:
    given = os.environ.get("MOE_OFFLOAD_HOST_RATES")
    return Path(given) if given else Path.home() / ".cache" / "moe-offload" / "host-rates.json"


def machine_key() -> str:
    return f"{_cpu_name()} | {best_isa().name.lower()} | {torch.get_num_threads()} threads"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure(again: bool = False, progress=None) -> HostRates:
    """The cached rates of this machine, or measured now (and cached) when there are none or `again`."""
    key, path = machine_key(), cache_path()
    known = read_cache(path)
    if not again and key in known:
        got = known[key]
        return HostRates(float(got["bytes_per_s"]), float(got["flops_per_s"]), key, False)
    if progress is not None:
        progress(f"measuring this host's read bandwidth and FLOP rate for the cost model (once: cached in {path})")
    rates = HostRates(_bandwidth(), _flops(), key, True)
    known[key] = {"bytes_per_s": rates.bytes_per_s, "flops_per_s": rates.flops_per_s}
    write_cache(path, known)
    return rates


def read_cache(path: Path) -> dict:
    """A per-machine cache file (JSON object), or {} when missing or damaged."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_cache(path: Path, data: dict) -> None:
    """A per-machine cache file written whole or not at all (a temporary file renamed over the old one); a
    read-only home leaves it unwritten (measured again next time)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        tmp.replace(path)
    except OSError:
        pass        # a read-only home: measured again next time


def _best(fn, rounds: int = 3) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def _bandwidth() -> float:
    """Bytes per second the kernels read when every expert serves one row (a decode step's shape)."""
    experts = READ_BYTES // (_O * _K * 2)
    stack = torch.full((experts, _O, _K), 0.01, dtype=torch.bfloat16)
    x = torch.randn(experts, _K)
    ids = torch.arange(experts)
    expert_gemv(x, stack, ids)                       # warm: pages touched, the kernels loaded
    return stack.numel() * 2 / _best(lambda: expert_gemv(x, stack, ids))


def _flops() -> float:
    """FLOPs per second of the kernels when each expert serves many rows (a prefill's shape)."""
    experts, rows = 4, 64
    stack = torch.full((experts, _O, _K), 0.01, dtype=torch.bfloat16)
    x = torch.randn(experts * rows, _K)
    ids = torch.arange(experts).repeat_interleave(rows)
    expert_gemv(x, stack, ids)
    return 2.0 * x.shape[0] * _O * _K / _best(lambda: expert_gemv(x, stack, ids))


def as_dict(rates: HostRates) -> dict:
    return asdict(rates)


def link_bytes_per_s(device: torch.device, progress=None) -> float | None:
    """The host -> device link's bandwidth (pinned host memory copied to the device, 256 MiB, best of three), cached
    beside the host's rates under the device's name; None on the cpu (no link). CUDA only: another accelerator's
    link is given (`--link-gbps`)."""
    if device.type != "cuda":
        return None
    key, path = f"link | {torch.cuda.get_device_name(device)}", cache_path()
    known = read_cache(path)
    if key in known:
        return float(known[key]["bytes_per_s"])
    if progress is not None:
        progress(f"measuring the host -> {device} link for the cost model (once: cached in {path})")
    src = torch.empty(READ_BYTES, dtype=torch.uint8).pin_memory()
    dst = torch.empty(READ_BYTES, dtype=torch.uint8, device=device)

    def copy():
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)

    copy()
    rate = READ_BYTES / _best(copy)
    known[key] = {"bytes_per_s": rate}
    write_cache(path, known)
    return rate
