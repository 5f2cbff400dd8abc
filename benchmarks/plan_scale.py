"""How long planning a 1-trillion-parameter model takes, and how much memory it needs.

Plans a Kimi-K2-shaped model (DeepseekV3 architecture, 61 layers, hidden 7168, 384 routed
experts top-8 + 1 shared, fp8 block quantization: 1.03T parameters) from a config.json
written to a temporary folder, at a few budgets. Nothing is downloaded and no weight is
allocated: the model is built on the meta device.

Each budget runs in a fresh Python process so that its peak RSS is its own:

    inventory_s    config.json -> meta model -> TensorRecords (first call in the process)
    plan_s         records -> Plan (the pure planner), median of --repeat calls
    total_s        moe_offload.plan(folder, ...) end to end, median of --repeat calls (warm)
    peak_rss_mib   the process's peak resident set (getrusage ru_maxrss), imports included
    import_rss_mib the same, measured after the imports only, before any planning
    py_peak_mib    tracemalloc's peak of Python allocations during one moe_offload.plan call

Usage: .venv/bin/python benchmarks/plan_scale.py [--json FILE] [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moe_offload.model.published import KIMI_K2


# (label, budget keywords for moe_offload.plan)
CASES = [
    ("offload 256 GiB", {"offload_gb": 256}),
    ("offload 768 GiB", {"offload_gb": 768}),
    ("H200 141 GiB", {"device_memory_gb": 141}),
    ("8xH200 1128 GiB", {"device_memory_gb": 1128}),
    ("declaration 768 GiB", {"offload_gb": 768, "policy": "declaration"}),
]
GiB = 1 << 30


def _rss_mib() -> float:
    # ru_maxrss is KiB on Linux, bytes on macOS.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024


def _worker(folder: str, budget: dict, repeat: int) -> dict:
    """Runs in a child process: one budget, measured."""
    import tracemalloc

    import moe_offload as mo
    from moe_offload.planning import planner
    from moe_offload.model.inventory import inventory

    import_rss = _rss_mib()
    t0 = time.perf_counter()
    inv = inventory(folder)
    inventory_s = time.perf_counter() - t0

    kwargs = {k: v for k, v in budget.items()}
    plan_times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        plan = planner.plan(inv, **kwargs)
        plan_times.append(time.perf_counter() - t0)

    total_times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        plan = mo.plan(folder, **kwargs)
        total_times.append(time.perf_counter() - t0)

    tracemalloc.start()
    mo.plan(folder, **kwargs)
    _, py_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()

    t0 = time.perf_counter()
    text = plan.to_json()
    to_json_s = time.perf_counter() - t0
    return {
        "budget": budget,
        "model_type": plan.model_type,
        "policy": plan.policy,
        "tensors": len(plan.tensors),
        "total_params": plan.total_params,
        "active_params": plan.active_params,
        "total_bytes": plan.total_bytes,
        "budget_bytes": plan.budget_bytes,
        "offloaded_bytes": plan.offloaded_bytes,
        "resident_bytes": plan.resident_bytes,
        "link_bytes_per_token": plan.link_bytes_per_token(),
        "inventory_s": inventory_s,
        "plan_s": statistics.median(plan_times),
        "total_s": statistics.median(total_times),
        "total_s_min": min(total_times),
        "to_json_s": to_json_s,
        "plan_json_bytes": len(text),
        "import_rss_mib": import_rss,
        "peak_rss_mib": _rss_mib(),
        "py_peak_mib": py_peak / (1 << 20),
        "notes": list(plan.notes),
    }


def _machine() -> dict:
    import torch
    import transformers

    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) / (1 << 20)  # GiB
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "memory_gib": mem, "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="bench-out/plan_scale.json", help="where to write the results")
    ap.add_argument("--repeat", type=int, default=3, help="timed calls per budget (median reported)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:  # child process
        spec = json.loads(args.worker)
        print(json.dumps(_worker(spec["folder"], spec["budget"], spec["repeat"])))
        return 0

    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(KIMI_K2))
        for label, budget in CASES:
            spec = json.dumps({"folder": tmp, "budget": budget, "repeat": args.repeat})
            proc = subprocess.run([sys.executable, __file__, "--worker", spec], capture_output=True, text=True)
            if proc.returncode != 0:
                console.print(f"[red]{label}: the worker failed[/red]\n{proc.stderr[-3000:]}")
                return 1
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            row["case"] = label
            rows.append(row)
            console.print(f"{label}: {row['total_s'] * 1e3:.0f} ms, peak RSS {row['peak_rss_mib']:.0f} MiB")

    first = rows[0]
    table = Table(title=(f"Planning Kimi-K2 ({first['total_params'] / 1e12:.3f}T params, "
                         f"{first['active_params'] / 1e9:.1f}B active, {first['total_bytes'] / GiB:.1f} GiB fp8, "
                         f"{first['tensors']} tensors)"))
    for col in ("case", "offloaded GiB", "resident GiB", "link GiB/tok", "inventory s", "planner ms",
                "plan() s", "import RSS MiB", "peak RSS MiB", "py peak MiB"):
        table.add_column(col, justify="left" if col == "case" else "right")
    for r in rows:
        table.add_row(r["case"], f"{r['offloaded_bytes'] / GiB:.1f}", f"{r['resident_bytes'] / GiB:.1f}",
                      f"{r['link_bytes_per_token'] / GiB:.3f}", f"{r['inventory_s']:.2f}", f"{r['plan_s'] * 1e3:.1f}",
                      f"{r['total_s']:.3f}", f"{r['import_rss_mib']:.0f}", f"{r['peak_rss_mib']:.0f}",
                      f"{r['py_peak_mib']:.1f}")
    Console(width=max(Console().width, 150)).print(table)

    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": "kimi_k2 (DeepseekV3ForCausalLM)", "config": KIMI_K2,
                               "machine": _machine(), "repeat": args.repeat, "rows": rows}, indent=1))
    Console(stderr=True).print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
