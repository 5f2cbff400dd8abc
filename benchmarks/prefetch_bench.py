"""The kernel's read shapes on this CPU: how fast expert_gemv reads weights from RAM with each.

The kernel asks for a row's lines some bytes ahead of where it reads (into L1 and into L2) and reads several rows of
one expert together (rows in flight; the source's header, src/moe_offload/kernels/csrc/expert_gemv.cpp, says why),
and the shapes that pay differ between cores. This
measures them where it matters, reads from RAM at a released model's sizes, bf16, 2 MiB pages:

- lm_head: Qwen3-30B-A3B's [151936 x 2048] (622 MB, far past any cache), one token;
- experts: 8 of 128 experts of [1536 x 2048] (Qwen3-30B-A3B's gate_up), 8 tokens each picking one, fresh ids
  every call from two stacks of 805 MB used in turn (so none is in cache).

All shapes run in one process, call after call in turn (round-robin), at each thread count, so the host's
noise falls on every shape alike; GB/s = bytes read / the median call's time. "default" is what the kernel
uses on this CPU when a call names none (moe_offload.kernels.prefetch_distances()).

    .venv/bin/python benchmarks/prefetch_bench.py [--threads 1 2] [--rounds 12] [--quick]

Writes bench-out/prefetch_bench.json; with neither --quick nor --out, docs/prefetch_bench.{md,json} and
docs/prefetch-bench.png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from moe_offload.kernels import Prefetch, best_isa, expert_gemv, prefetch_distances
from moe_offload.kernels.host_rates import machine_key
from moe_offload.storage.huge_pages import advise_huge

ROOT = Path(__file__).resolve().parent.parent
DISTANCES = (Prefetch(0, 0), Prefetch(512, 0), Prefetch(512, 2048), Prefetch(512, 4096), Prefetch(1024, 2048),
             Prefetch(1024, 4096), Prefetch(2048, 8192), Prefetch(0, 0, 8), Prefetch(256, 0, 8), Prefetch(256, 0, 4),
             Prefetch(1024, 4096, 8))
HIDDEN, VOCAB, EXPERTS, ROWS, TOP_K = 2048, 151936, 128, 1536, 8


def label(p: Prefetch) -> str:
    ahead = "none" if p.l1 == p.l2 == 0 else f"{p.l1} / {p.l2}"
    return ahead if p.rows == 1 else f"{ahead}, {p.rows} rows"


def huge(shape: tuple[int, ...]) -> torch.Tensor:
    t = torch.empty(shape, dtype=torch.bfloat16)
    advise_huge(t)
    return t.copy_(torch.randn(shape))


def measure(threads: int, distances: list[Prefetch], rounds: int, small: bool) -> list[dict]:
    torch.set_num_threads(threads)
    isa = best_isa()
    vocab = VOCAB // 8 if small else VOCAB
    lm = huge((1, vocab, HIDDEN))
    stacks = [huge((EXPERTS // 8 if small else EXPERTS, ROWS, HIDDEN)) for _ in range(2)]
    x1, x8 = torch.randn(1, HIDDEN), torch.randn(TOP_K, HIDDEN)
    zero = torch.zeros(1, dtype=torch.long)
    times = {label(p): ([], []) for p in distances}
    for r in range(rounds + 1):   # round 0 warms up
        for p in distances:
            t = time.perf_counter()
            expert_gemv(x1, lm, zero, isa=isa, prefetch=p)
            lm_t = time.perf_counter() - t
            ex_t = []
            for k in range(4):
                ids = torch.randperm(stacks[0].shape[0])[:TOP_K]
                t = time.perf_counter()
                expert_gemv(x8, stacks[k % 2], ids, isa=isa, prefetch=p)
                ex_t.append(time.perf_counter() - t)
            if r:
                times[label(p)][0].append(lm_t)
                times[label(p)][1].extend(ex_t)
    lm_bytes, ex_bytes = lm.numel() * 2, TOP_K * ROWS * HIDDEN * 2
    return [{"threads": threads, "distances": name, "lm_head_gbs": round(lm_bytes / statistics.median(a) / 1e9, 1),
             "experts_gbs": round(ex_bytes / statistics.median(b) / 1e9, 1)}
            for name, (a, b) in times.items()]


def plot(rows: list[dict], default: str, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["distances"] for r in rows))
    threads = sorted({r["threads"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    width = 0.8 / len(threads)
    panels = (("lm_head_gbs", "lm_head [151936 x 2048]"), ("experts_gbs", "8 experts [1536 x 2048]"))
    for ax, (key, what) in zip(axes, panels):
        for i, t in enumerate(threads):
            vals = [next(r[key] for r in rows if r["threads"] == t and r["distances"] == n) for n in names]
            ax.bar([j + i * width for j in range(len(names))], vals, width, label=f"{t} thread{'s' * (t > 1)}")
        ax.set_xticks([j + width * (len(threads) - 1) / 2 for j in range(len(names))],
                      [n + (" *" if n == default else "") for n in names], rotation=30, fontsize=8)
        ax.set_title(what, fontsize=10)
        ax.set_xlabel("prefetch L1 / L2 bytes ahead, rows in flight (* this CPU's default)")
    axes[0].set_ylabel("GB/s read from RAM")
    axes[0].legend(loc="lower left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--quick", action="store_true", help="an eighth of the sizes, 2 rounds: the pipeline end to end")
    ap.add_argument("--out", type=Path, help="write only here (default: bench-out/, and docs/ unless --quick)")
    a = ap.parse_args(argv)
    rounds = 2 if a.quick else a.rounds
    default = label(prefetch_distances())
    distances = list(DISTANCES) + ([prefetch_distances()] if default not in map(label, DISTANCES) else [])
    rows, before = [], torch.get_num_threads()
    try:
        for t in a.threads:
            rows += measure(t, distances, rounds, a.quick)
    finally:
        torch.set_num_threads(before)
    machine = f"{machine_key().rsplit(' | ', 1)[0]}, {platform.system()} {platform.release()}"
    print(f"expert_gemv read rate by read shape: {machine}; {rounds} rounds")
    table = Table()
    for col in ("threads", "L1 / L2 bytes ahead, rows", "lm_head GB/s", "experts GB/s"):
        table.add_column(col, justify="right")
    for r in rows:
        mark = " (default)" if r["distances"] == default else ""
        table.add_row(str(r["threads"]), r["distances"] + mark, str(r["lm_head_gbs"]), str(r["experts_gbs"]))
    Console(highlight=False, width=max(Console().width, 110)).print(table)
    result = {"machine": machine, "date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "rounds": rounds, "quick": a.quick, "default": default, "rows": rows}
    outs = [a.out] if a.out else [ROOT / "bench-out"] + ([] if a.quick else [ROOT / "docs"])
    for out in outs:
        out.mkdir(parents=True, exist_ok=True)
        (out / "prefetch_bench.json").write_text(json.dumps(result, indent=1) + "\n")
    if not a.quick and not a.out:
        plot(rows, default, ROOT / "docs" / "prefetch-bench.png", f"expert_gemv read shapes, {machine}")
        lines = ["# The kernel's read shapes: prefetch distances and rows in flight", "",
                 f"Written by `benchmarks/prefetch_bench.py` (its docstring is the method) on {result['date']}: "
                 f"{machine}, torch {torch.__version__}, {rounds} rounds. This CPU's default: {default}.", "",
                 "| threads | L1 / L2 bytes ahead, rows | lm_head GB/s | experts GB/s |", "|---|---|---|---|"]
        lines += [f"| {r['threads']} | {r['distances']}{' (default)' if r['distances'] == default else ''} | "
                  f"{r['lm_head_gbs']} | {r['experts_gbs']} |" for r in rows]
        lines += ["", "![read rate by read shape](prefetch-bench.png)", ""]
        (ROOT / "docs" / "prefetch_bench.md").write_text("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
