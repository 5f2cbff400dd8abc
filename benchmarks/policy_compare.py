"""What the offload order costs on released models: declaration order against sparse-first.

For each model (published hyper-parameters, moe_offload.model.published; nothing downloaded)
and each accelerator size, both policies plan at the same `--device-memory`, and the plan
gives the expected bytes of offloaded weights read per decoded token (uniform routing,
batch 1 and 8). Dividing by a link bandwidth gives the time those bytes take on PCIe
Gen4 (25 GB/s) and Gen5 (55 GB/s). These are planned figures, computed from byte sizes:
no timing is measured here, and compute time is not included.

Usage: .venv/bin/python benchmarks/policy_compare.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

import moe_offload as mo
from moe_offload.errors import BudgetError
from moe_offload.planning.placement import format_bytes
from moe_offload.model.published import write

GiB = 1 << 30
CASES = [  # (model, accelerator memory in GiB): each a model that does not fit on that accelerator
    ("qwen3-30b-a3b", 24), ("qwen3-30b-a3b", 40),
    ("mixtral-8x7b", 48), ("mixtral-8x7b", 80),
    ("gpt-oss-120b", 48),
    ("deepseek-v3", 141), ("kimi-k2", 141),
]
RESERVE_GB = 4.0
LINKS_GBPS = (25.0, 55.0)


def rows() -> list[dict]:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, memory in CASES:
            folder = write(name, Path(tmp) / name)
            row = {"model": name, "device_memory_gb": memory, "reserve_gb": RESERVE_GB}
            for policy in ("declaration", "sparse-first"):
                try:
                    plan = mo.plan(folder, device_memory_gb=memory, reserve_gb=RESERVE_GB, policy=policy)
                except BudgetError as exc:
                    row[policy] = {"error": str(exc)}
                    continue
                row["total_bytes"] = plan.total_bytes
                row[policy] = {"offloaded_bytes": plan.offloaded_bytes,
                               "link_bytes_per_token": plan.link_bytes_per_token(1),
                               "link_bytes_per_token_batch8": plan.link_bytes_per_token(8)}
            out.append(row)
    return out


def table(data: list[dict]) -> Table:
    t = Table(title="planned link traffic per decoded token, same budget (--device-memory, 4 GiB reserve)",
              title_justify="left")
    for col in ("model", "weights", "device", "offloaded", "declaration /tok", "sparse-first /tok", "ratio",
                "ms/tok Gen4 decl -> sparse", "batch 8 ratio"):
        t.add_column(col, justify="left" if col == "model" else "right")
    for r in data:
        d, s = r["declaration"], r["sparse-first"]
        if "error" in d or "error" in s:
            t.add_row(r["model"], "", f"{r['device_memory_gb']} GiB", "does not fit", "", "", "", "", "")
            continue
        ms = [x["link_bytes_per_token"] / (LINKS_GBPS[0] * 1e9) * 1e3 for x in (d, s)]
        t.add_row(r["model"], format_bytes(r["total_bytes"]), f"{r['device_memory_gb']} GiB",
                  format_bytes(s["offloaded_bytes"]), format_bytes(d["link_bytes_per_token"]),
                  format_bytes(s["link_bytes_per_token"]),
                  f"{d['link_bytes_per_token'] / s['link_bytes_per_token']:.2f}x",
                  f"{ms[0]:.1f} -> {ms[1]:.1f}",
                  f"{d['link_bytes_per_token_batch8'] / s['link_bytes_per_token_batch8']:.2f}x")
    return t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="bench-out/policy_compare.json")
    args = parser.parse_args()
    data = rows()
    Console().print(table(data))
    Console().print("planned from byte sizes and uniform routing; not a timing. "
                    "ms/tok: link bytes over 25 GB/s, compute excluded.")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"links_gbps": LINKS_GBPS, "rows": data}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
