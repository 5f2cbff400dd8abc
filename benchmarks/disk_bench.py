"""The disk tier against accelerate's disk offload, on this machine, at one RAM budget.

A qwen3_moe made here (random weights, bf16, 10 layers, 32 experts top-2, hidden 1536: 6.5 GiB, written
layer by layer by the streaming make_tiny and cached in models/, git-ignored) runs on the CPU with a RAM
budget of 3 GiB (by default), three ways, each in a fresh process so that its peak RSS is its own:

- `sparse-first (disk tier)`: moe_offload.load with the plan `--device-memory BUDGET --reserve-gb R` makes on a
  CPU-only machine (what does not fit RAM is on the disk tier: lowest access density first, so routed
  experts), read in place from the checkpoint (O_DIRECT) while the model runs;
- `accelerate`: from_pretrained(device_map="auto", max_memory={"cpu": the same resident bytes},
  offload_folder=...) (accelerate_arm.AccelerateArm), the peer users reach for first;
- `resident`: the whole model in RAM (no budget): the ceiling.

Measured per arm: decode tok/s (1 / median inter-token latency, bench._greedy's loop), disk bytes per decoded
token (the runtime's disk counter; for accelerate /proc/self/io read_bytes, page cache released before each
step), /proc/self/io read_bytes per step for every arm, peak RSS (VmHWM from just before load to the end).
Plus the disk itself: sequential and random O_DIRECT read bandwidth (random reads at the size of one
expert's matrix, the size the disk tier reads), so that bytes per token / bandwidth is the floor of a decode
step. Rows go to bench-out/disk_bench.{json,md,png} and docs/disk_bench.{md,png}.

    .venv/bin/python benchmarks/disk_bench.py [--budget-gb 3] [--tokens 6]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "disk-bench-qwen3moe-6g"
SHAPE = dict(family="qwen3_moe", layers=10, experts=32, top_k=2, hidden=1536, dtype="bf16", max_shard_size="1GB")
PROMPT = "The harbour master counted"   # short: a prefill's distinct experts are staged at once
ARMS = ("sparse-first", "accelerate", "resident")
GiB = 1 << 30


def ensure_model(folder: Path) -> Path:
    if (folder / "config.json").is_file():
        return folder
    from moe_offload.tiny.make import make_tiny

    print(f"making {folder.name} (once; cached) ...", file=sys.stderr)
    return make_tiny(folder, progress=True, **SHAPE)


# --- the disk's own bandwidth --------------------------------------------------------------------------------

def disk_bandwidth(folder: Path, *, seq_bytes: int = 2 * GiB, block: int = 8 << 20, rand_block: int,
                   rand_reads: int = 120, seed: int = 0) -> dict:
    """O_DIRECT read bandwidth of the checkpoint's own files: sequential (8 MiB reads in file order) and random
    (reads of `rand_block` bytes at random 4 KiB-aligned offsets across every shard)."""
    files = sorted(folder.glob("*.safetensors"))
    buf = mmap.mmap(-1, max(block, rand_block))
    view = memoryview(buf)

    def timed(reads) -> float:
        total, start = 0, time.perf_counter()
        for fd, off, n in reads:
            total += os.preadv(fd, [view[:n]], off)
        return total / (time.perf_counter() - start)

    fds = [os.open(p, os.O_RDONLY | os.O_DIRECT) for p in files]
    try:
        seq, left = [], seq_bytes
        for fd, p in zip(fds, files):
            size = os.path.getsize(p) // block * block
            for off in range(0, size, block):
                if left <= 0:
                    break
                seq.append((fd, off, block))
                left -= block
        rng = random.Random(seed)
        rand = []
        for _ in range(rand_reads):
            i = rng.randrange(len(files))
            top = (os.path.getsize(files[i]) - rand_block) // 4096
            rand.append((fds[i], rng.randrange(max(1, top)) * 4096, rand_block))
        return {"sequential_bytes_per_s": timed(seq), "random_bytes_per_s": timed(rand),
                "random_read_bytes": rand_block, "sequential_read_bytes": block, "mechanism": "O_DIRECT"}
    finally:
        for fd in fds:
            os.close(fd)
        view.release()
        buf.close()


# --- one arm, in its own process ---------------------------------------------------------------------------

def _io_read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def disk_plan(folder: Path, budget_gb: float, reserve_gb: float, stats: dict | None = None):
    """The plan a CPU-only machine makes for `--device-memory budget --reserve-gb reserve`: RAM is the device,
    everything that leaves it is on the disk tier (a host-tier placement, where the planner still gives one, is
    read as disk: on a CPU there is no other memory). `stats` (layer -> picks per expert): the frequency policy's
    plan, the experts RAM holds chosen by those routing statistics."""
    import dataclasses

    import moe_offload as mo

    policy = dict(policy="frequency", stats={int(k): v for k, v in stats.items()}) if stats else {}
    plan = mo.plan(folder, device_memory_gb=budget_gb, reserve_gb=reserve_gb, **policy)
    return dataclasses.replace(plan, tensors=tuple(dataclasses.replace(t, tier="disk") if t.tier == "host" else t
                                                   for t in plan.tensors))


class _Meter:
    """bench._greedy's meter for moe_offload arms: disk counter + host counter bytes of each step, and the
    process's /proc/self/io read_bytes over it."""

    def __init__(self, rt):
        self.rt, self.io = rt, []

    def before_step(self):
        self._io = _io_read_bytes()

    def step(self) -> int:
        self.io.append(_io_read_bytes() - self._io)
        return self.rt.disk_counter.calls[-1][1] + self.rt.counter.calls[-1][1]


def child(arm: str, folder: Path, budget_gb: float, reserve_gb: float, tokens: int, threads: int) -> dict:
    import torch

    from moe_offload.measure.accelerate_arm import AccelerateArm
    from moe_offload.measure.timing import greedy as _greedy, peak_rss_bytes, reset_peak_rss
    from moe_offload.loading.loader import load, load_tokenizer

    # One thread by default: on this shared 2-core VM two OpenMP threads make small kernels (the eager experts
    # loop's index_add_) 1000x slower when the other core is busy.
    torch.set_num_threads(threads)
    tokenizer = load_tokenizer(folder)
    enc = tokenizer([PROMPT], return_tensors="pt")
    plan = disk_plan(folder, budget_gb, reserve_gb)
    import transformers  # noqa: F401  (imports done before the peak is reset)

    reset_peak_rss()
    base = peak_rss_bytes()
    start = time.perf_counter()
    extra = {}
    if arm == "accelerate":
        acc = AccelerateArm.load(folder, plan, torch.device("cpu"))
        model, meter = acc.model, acc
    else:
        model, plan_used = load(folder, device="cpu", plan=plan if arm == "sparse-first" else None,
                                **({} if arm == "sparse-first" else {"offload_gb": 0}))
        rt = model.moe_offload_runtime
        meter = _Meter(rt)
    load_s = time.perf_counter() - start
    with torch.no_grad():
        _greedy(model, enc, 2, torch.device("cpu"), meter=meter)            # warm-up, discarded
        if arm == "accelerate":
            acc.reset()
        else:
            meter.io.clear()
        run = _greedy(model, enc, tokens, torch.device("cpu"), meter=meter)
    peak = peak_rss_bytes()
    itl = run.itl_s
    if arm == "accelerate":
        per = acc.per_token(1, skip_first_run=False)
        disk_per_token = per["disk_read_bytes_per_token"]
        io_per_token = disk_per_token
        extra = {"offload_loaded_bytes_per_token": per["offload_loaded_bytes_per_token"],
                 "resident_bytes": acc.bytes_by_placement().get("cpu", 0),
                 "disk_bytes": acc.bytes_by_placement().get("disk", 0),
                 "mechanism": "accelerate hooks: every weight of an offloaded module loaded at each forward"}
        acc.close()
    else:
        disk_per_token = rt.disk_counter.decode_bytes_per_token()
        io_per_token = statistics.mean(meter.io) if meter.io else 0.0
        extra = {"resident_bytes": plan_used.resident_bytes,
                 "disk_bytes": sum(t.offloaded_bytes for t in plan_used.tensors if t.tier == "disk"),
                 "planned_disk_read_bytes_per_token": plan_used.token_bytes().expected()[1],
                 "disk_staging_bytes": rt.disk.staging_bytes if rt.disk is not None else 0,
                 "row_buffer_bytes": sum(b.numel() * b.element_size() for b in rt._staging.values()),
                 "disk_read_calls": rt.disk.read_calls if rt.disk is not None else 0,
                 "mechanism": rt.mechanism}
    return {"arm": "sparse-first (disk tier)" if arm == "sparse-first" else arm,
            "tokens": tokens, "decode_steps": len(itl), "itl_p50_ms": statistics.median(itl) * 1e3,
            "tok_s_decode": 1 / statistics.median(itl), "ttft_ms": run.ttft_s * 1e3, "load_s": load_s,
            "disk_read_bytes_per_token": disk_per_token, "proc_io_read_bytes_per_token": io_per_token,
            "peak_rss_bytes": peak, "baseline_rss_bytes": base, "threads": threads, "token_ids": run.token_ids[0].tolist(), **extra}


# --- the report ----------------------------------------------------------------------------------------------

def report(rows: list[dict], disk: dict, budget_gb: float, out_dirs: list[Path]) -> str:
    by = {r["arm"]: r for r in rows}
    ours, acc = by.get("sparse-first (disk tier)"), by.get("accelerate")
    lines = [f"RAM budget {budget_gb:g} GiB; model {MODEL.name} ({rows[0].get('total_gib', 0):.2f} GiB bf16); "
             f"disk (O_DIRECT): sequential {disk['sequential_bytes_per_s'] / 1e9:.2f} GB/s, random "
             f"{disk['random_read_bytes'] >> 20} MiB reads {disk['random_bytes_per_s'] / 1e9:.2f} GB/s"
             + (f" (means of before / after the arms: random {disk['before']['random_bytes_per_s'] / 1e9:.2f} / "
                f"{disk['after']['random_bytes_per_s'] / 1e9:.2f} GB/s)" if "before" in disk else ""), "",
             "| arm | decode tok/s | ITL p50 ms | disk MiB / token (counted) | /proc/self/io MiB / token | "
             "peak RSS GiB | floor ms (bytes / random bw) | load s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        floor = r["disk_read_bytes_per_token"] / disk["random_bytes_per_s"] * 1e3
        r["floor_ms_per_token"] = floor
        lines.append(f"| {r['arm']} | {r['tok_s_decode']:.2f} | {r['itl_p50_ms']:.0f} | "
                     f"{r['disk_read_bytes_per_token'] / 2**20:.1f} | {r['proc_io_read_bytes_per_token'] / 2**20:.1f} | "
                     f"{r['peak_rss_bytes'] / GiB:.2f} | {floor:.0f} | {r['load_s']:.1f} |")
    goals = []
    if ours and acc:
        speedup = ours["tok_s_decode"] / acc["tok_s_decode"]
        goals.append(f"decode tok/s vs accelerate: {speedup:.1f}x (goal >= 3x: {'met' if speedup >= 3 else 'NOT met'})")
    if ours:
        rss = ours["peak_rss_bytes"] / (budget_gb * GiB)
        goals.append(f"peak RSS {ours['peak_rss_bytes'] / GiB:.2f} GiB = {rss:.2f}x the budget, process baseline "
                     f"{ours['baseline_rss_bytes'] / GiB:.2f} GiB included (goal <= 1.10x: "
                     f"{'met' if rss <= 1.1 else 'NOT met'})")
        ratio = ours["itl_p50_ms"] / ours["floor_ms_per_token"] if ours["floor_ms_per_token"] else float("inf")
        goals.append(f"decode time {ours['itl_p50_ms']:.0f} ms = {ratio:.2f}x the floor {ours['floor_ms_per_token']:.0f} "
                     f"ms (goal <= 1.5x: {'met' if ratio <= 1.5 else 'NOT met'})")
        if "resident" in by:
            same = ours["token_ids"] == by["resident"]["token_ids"]
            goals.append(f"greedy tokens identical to the model fully in RAM: {same}")
    text = "\n".join(lines + [""] + [f"- {g}" for g in goals]) + "\n"
    for d in out_dirs:
        d.mkdir(parents=True, exist_ok=True)
        (d / "disk_bench.md").write_text(text)
    return text


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    names = [r["arm"] for r in rows]
    for ax, key, label, scale in ((axes[0], "tok_s_decode", "decode tokens / s", 1),
                                  (axes[1], "disk_read_bytes_per_token", "disk MiB read per token", 2**20),
                                  (axes[2], "peak_rss_bytes", "peak RSS GiB", GiB)):
        bars = ax.bar(names, [r[key] / scale for r in rows], color=["tab:blue", "tab:orange", "tab:green"][:len(rows)])
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
        ax.set_ylabel(label)
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(f"{MODEL.name} on {os.cpu_count()} CPU cores, disk tier vs accelerate vs all in RAM")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--budget-gb", type=float, default=3.0)
    ap.add_argument("--reserve-gb", type=float, default=0.85,
                    help="of the budget, kept for the process itself (~0.4 GiB of torch + transformers), the "
                         "prefill's staged experts, activations and the KV cache")
    ap.add_argument("--tokens", type=int, default=6)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads of every arm")
    ap.add_argument("--child", choices=ARMS)
    args = ap.parse_args(argv)
    folder = args.model
    if args.child:
        print(json.dumps(child(args.child, folder, args.budget_gb, args.reserve_gb, args.tokens, args.threads)))
        return 0
    ensure_model(folder)
    import moe_offload as mo

    total = mo.plan(folder, offload_gb=0).total_bytes
    expert = max(t.bytes // t.shape[0] for t in mo.plan(folder, offload_gb=0).tensors if t.role == "routed_expert")
    disk = disk_bandwidth(folder, rand_block=-(-expert // 4096) * 4096)
    print(f"disk: {json.dumps(disk)}", file=sys.stderr)
    rows = []
    for arm in args.arms.split(","):
        print(f"arm {arm} ...", file=sys.stderr)
        cmd = [sys.executable, __file__, "--child", arm, "--model", str(folder), "--budget-gb", str(args.budget_gb),
               "--reserve-gb", str(args.reserve_gb), "--tokens", str(args.tokens), "--threads", str(args.threads)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            print(out.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"arm {arm} failed (exit {out.returncode})")
        row = json.loads(out.stdout.strip().splitlines()[-1])
        row["total_gib"] = total / GiB
        rows.append(row)
        print(f"  {row['tok_s_decode']:.2f} tok/s, {row['disk_read_bytes_per_token'] / 2**20:.1f} MiB/token, "
              f"peak RSS {row['peak_rss_bytes'] / GiB:.2f} GiB", file=sys.stderr)
    after = disk_bandwidth(folder, rand_block=disk["random_read_bytes"])   # a shared disk's speed drifts
    disk = {**disk, "before": dict(disk), "after": after,
            "sequential_bytes_per_s": (disk["sequential_bytes_per_s"] + after["sequential_bytes_per_s"]) / 2,
            "random_bytes_per_s": (disk["random_bytes_per_s"] + after["random_bytes_per_s"]) / 2}
    outs = [ROOT / "bench-out", ROOT / "docs"]
    text = report(rows, disk, args.budget_gb, outs)
    result = {"model": folder.name, "total_bytes": total, "budget_gb": args.budget_gb, "reserve_gb": args.reserve_gb,
              "disk": disk, "rows": rows}
    for d in outs:
        (d / "disk_bench.json").write_text(json.dumps(result, indent=1))
        plot(rows, d / "disk_bench.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
