"""One MoE layer's routed experts at released model sizes: our stored-format kernels against memory speed,
llama.cpp's kernels and kt-kernel.

What is timed is one decode step of one layer's routed experts, 1 token and 4 tokens, at 1 and 2 threads, with
random weights (speed does not depend on their values) at the released configs' sizes:

- Qwen3-30B-A3B: hidden 2048, 128 experts of width 768, top-8; bf16 and FP8 (e4m3, 128x128 float32 block
  scales, as Qwen's FP8 release).
- gpt-oss-20b: hidden 2880, 32 experts of width 2880, top-4; MXFP4 (e2m1 + e8m0 per 32, as released) and bf16.
- DeepSeek-V2-Lite: hidden 2048, 64 experts of width 1408, top-6; bf16.

Ours (moe_offload.kernels.expert_gemv, the best ISA path this CPU runs): x [S*k, H] (each token's hidden once
per selected expert) through the gate_up stack [E, 2I, H], SiLU(gate) * up in torch, through the down stack
[E, H, I], then the routing-weighted sum over each token's k experts in torch: the whole routed-expert layer, the
same work kt-kernel's forward does. Each token's top-k is drawn at random on its own (so 4 tokens' experts
overlap as real routing does); every call gets fresh ids; the same id sequence goes to every engine. Time: the
median of --reps calls (default 40) after 5 warm-up calls, torch.set_num_threads(T). Bytes read = distinct
selected experts x 3*H*I weights x bytes per weight (bf16 2; FP8 1 plus its block scales; MXFP4 17/32 with its
scales); GB/s = bytes / time, the median over calls.

Memory read bandwidth: a 2 GiB buffer (written first, so its pages are real), read once per call by a few torch
reductions (int64 sum, float32 sum, int32 max), at the start and after each shape (this host's bandwidth varies
with its other tenants); the best call is "measured read bandwidth", and each row is a percentage of it.

kt-kernel (KTransformers' CPU MoE kernels, PyPI kt-kernel 0.7.2): in its own venv (created under
~/.cache/moe-offload/engines/kt-kernel-venv when missing), one child process per kernel class and thread count,
driven through its extension classes as its wrappers drive them (benchmarks/kernel_bench_kt.py says how). Its
bf16, FP8 and MXFP4 kernels run the same formats; its INT8/INT4 (AMXInt8_MOE / AMXInt4_MOE, quantized online
from bf16) and llamafile GGUF Q8_0 / Q4_0 kernels are extra rows in other formats (their own nominal bytes).
"x kt-kernel" = the fastest kt-kernel class of the same format's time / ours (above 1: ours is faster).

llama.cpp (its ggml CPU kernels at the commit `make engines` built; benchmarks/kernel_bench_ggml.py builds a
harness, benchmarks/ggml_layer.cpp, against them once): the graph llama.cpp builds for this FFN at decode, one
process per format and thread count, the same ids. Formats: bf16 and MXFP4 (the same bytes as ours), Q8_0 against
our FP8 (llama.cpp has no FP8; Q8_0 is its 8-bit format, 34 bytes per 32 weights against FP8's 32 + scales), Q4_0
an extra row. "x llama.cpp" = llama.cpp's time for the compared format / ours. Before
each row the script waits (up to --max-wait s) for other processes to use under 10% of the CPUs, and records
their share of the CPU time while the row ran ("others' CPU").

    .venv/bin/python benchmarks/kernel_bench.py [--quick] [--no-kt] [--no-llama] [--reps N] [--max-wait S]

--quick: Qwen3-30B-A3B only, 1 thread, 10 reps (a smoke check; writes bench-out/ only). Otherwise bench-out/
and docs/ (kernel_bench.md, kernel_bench.json, kernel-bench.png).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import timeit
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_bench_ggml as gg  # noqa: E402
import kernel_bench_kt as kt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {   # name: (H, experts, I, top_k, our formats)
    "Qwen3-30B-A3B": (2048, 128, 768, 8, ["bf16", "fp8"]),
    "gpt-oss-20b": (2880, 32, 2880, 4, ["mxfp4", "bf16"]),
    "DeepSeek-V2-Lite": (2048, 64, 1408, 6, ["bf16"]),
}
KT = {   # (shape, format): kt-kernel classes, the one its wrappers pick on an AVX-512 CPU first
    ("Qwen3-30B-A3B", "bf16"): ["AMXBF16_MOE", "AVX2BF16_MOE"],
    ("Qwen3-30B-A3B", "fp8"): ["AMXFP8_MOE", "AVX2FP8_MOE"],
    ("Qwen3-30B-A3B", "int8"): ["AMXInt8_MOE"],
    ("Qwen3-30B-A3B", "int4"): ["AMXInt4_MOE"],
    ("Qwen3-30B-A3B", "Q8_0"): ["MOE"],
    ("Qwen3-30B-A3B", "Q4_0"): ["MOE"],
    ("gpt-oss-20b", "mxfp4"): ["AMXFP4_KGroup_MOE", "AVX2MXFP4_MOE"],
    ("gpt-oss-20b", "bf16"): ["AMXBF16_MOE", "AVX2BF16_MOE"],
    ("DeepSeek-V2-Lite", "bf16"): ["AMXBF16_MOE", "AVX2BF16_MOE"],
}
GGML = {   # (shape, our format): llama.cpp formats run on the same ids (the first one is the one compared)
    ("Qwen3-30B-A3B", "bf16"): ["bf16", "Q4_0"],
    ("Qwen3-30B-A3B", "fp8"): ["Q8_0"],
    ("gpt-oss-20b", "mxfp4"): ["mxfp4"],
    ("gpt-oss-20b", "bf16"): ["bf16"],
    ("DeepSeek-V2-Lite", "bf16"): ["bf16"],
}
EXTRA = {"int8": "INT8, per-row scales", "int4": "INT4, per-row scales", "Q8_0": "GGUF Q8_0", "Q4_0": "GGUF Q4_0"}
WARMUP = 5


def matrix_bytes(fmt: str, O: int, K: int) -> float:
    """Stored bytes of one [O, K] matrix in `fmt`, scales included (nominal for kt-kernel's own formats)."""
    if fmt == "bf16":
        return 2 * O * K
    if fmt == "fp8":
        return O * K + 4 * -(-O // 128) * -(-K // 128)
    if fmt == "mxfp4":
        return O * K * 17 / 32
    if fmt in ("int8", "int4"):
        return O * K * (1 if fmt == "int8" else 0.5) + 4 * O
    return O * K * {"Q8_0": 34, "Q4_0": 18}[fmt] / 32


def machine() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in subprocess.run(["lscpu"], capture_output=True, text=True)
                .stdout.splitlines() if ln.startswith("Model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "tree": subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                                   text=True).stdout.strip() or None}


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _ticks() -> tuple[int, int, float]:
    """(busy, all) CPU ticks of the whole machine, and ours (this process and its finished children)."""
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    t = os.times()
    return sum(v) - v[3] - v[4], sum(v), (t.user + t.system + t.children_user + t.children_system) * os.sysconf(
        "SC_CLK_TCK")


class Others:
    """Other processes' share of the machine's CPU time over a `with` block (/proc/stat less our own ticks)."""

    def __enter__(self):
        self.a = _ticks()
        return self

    def __exit__(self, *exc):
        b = _ticks()
        self.share = max(0.0, (b[0] - self.a[0] - (b[2] - self.a[2])) / max(1, b[1] - self.a[1]))


def wait_quiet(max_wait: float) -> None:
    """Wait (at most max_wait s) until other processes use under 10% of the CPUs over a second."""
    t0 = time.time()
    while True:
        with Others() as o:
            time.sleep(1.0)
        if o.share < 0.1 or time.time() - t0 > max_wait:
            return
        print(f"other work uses {o.share:.0%} of the CPUs: waiting ...", file=sys.stderr)


# --- memory bandwidth --------------------------------------------------------------------------------------------

def bandwidth(threads: list[int], best: dict, max_wait: float) -> None:
    """Raise best {T: {way: GB/s}} to this sample's: a 2 GiB buffer read once per call, best of 5 calls."""
    wait_quiet(max_wait)
    buf = torch.empty(2 << 30, dtype=torch.uint8).fill_(1)
    ways = {"int64 sum": lambda: buf.view(torch.int64).sum(), "float32 sum": lambda: buf.view(torch.float32).sum(),
            "int32 max": lambda: buf.view(torch.int32).max()}
    for T in threads:
        torch.set_num_threads(T)
        for name, fn in ways.items():
            fn()
            gbs = buf.numel() / min(timeit.repeat(fn, number=1, repeat=5)) / 1e9
            best.setdefault(T, {})[name] = max(gbs, best.get(T, {}).get(name, 0.0))


# --- our kernels --------------------------------------------------------------------------------------------------

def draw_ids(E: int, k: int, tokens: int, calls: int, seed: int) -> list[list[int]]:
    """Per call the k experts of each token, drawn independently per token: flat [tokens * k]."""
    g = torch.Generator().manual_seed(seed)
    return [torch.cat([torch.randperm(E, generator=g)[:k] for _ in range(tokens)]).tolist() for _ in range(calls)]


def rand_bf16(*shape) -> torch.Tensor:
    """Random sign and mantissa, exponent fixed (|w| in [2^-7, 2^-6)): no NaN, no subnormals."""
    bits = torch.randint(-32768, 32767, shape, dtype=torch.int16)
    return ((bits & 0x807F) | 0x3C00).view(torch.bfloat16)


def make_stack(fmt: str, E: int, O: int, K: int, parts: int):
    from moe_offload.kernels import Fp8Stack, Mxfp4Stack, fp8_row_blocks

    if fmt == "bf16":
        return rand_bf16(E, O, K)
    if fmt == "fp8":   # e4m3 bytes without the NaN codes 0x7F / 0xFF
        v = torch.randint(0, 0x7F, (E, O, K), dtype=torch.uint8) | (torch.randint(0, 2, (E, O, K), dtype=torch.uint8)
                                                                    << 7)
        s = torch.rand(E, parts * -(-(O // parts) // 128), -(-K // 128)) * 1e-3 + 1e-3
        return Fp8Stack(v, s, fp8_row_blocks(O, 128, parts=parts), 128)
    if fmt == "mxfp4":
        return Mxfp4Stack(torch.randint(0, 256, (E, O, K // 32, 16), dtype=torch.uint8),
                          torch.randint(118, 131, (E, O, K // 32), dtype=torch.uint8))
    raise ValueError(fmt)


def bench_ours(H, E, I, k, fmt, threads, ids_by_tokens, max_wait) -> list[dict]:
    from moe_offload.kernels import expert_gemv

    gate_up, down = make_stack(fmt, E, 2 * I, H, 2), make_stack(fmt, E, H, I, 1)
    rows = []
    for T in threads:
        torch.set_num_threads(T)
        for S, calls in ids_by_tokens.items():
            x = (torch.randn(S, H) * 0.5).to(torch.bfloat16).repeat_interleave(k, dim=0)
            w = torch.full((S, k, 1), 1.0 / k)
            times = []
            wait_quiet(max_wait)
            with Others() as others:
                for flat in calls:
                    ids = torch.tensor(flat, dtype=torch.int64)
                    t = time.perf_counter()
                    gu = expert_gemv(x, gate_up, ids)
                    h = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
                    y = (expert_gemv(h, down, ids).view(S, k, H) * w).sum(1)
                    times.append(time.perf_counter() - t)
            assert torch.isfinite(y).all()
            rows.append({"threads": T, "tokens": S, "engine": "ours", "times_us": [t * 1e6 for t in times[WARMUP:]],
                         "others": others.share})
    del gate_up, down
    return rows


# --- one run ------------------------------------------------------------------------------------------------------

def summarize(row: dict, H: int, I: int, ids: list[list[int]]) -> dict:
    """us (median), GB/s (median over calls of that call's distinct experts' bytes / its time)."""
    per_expert = 2 * matrix_bytes(row["format"], I, H) + matrix_bytes(row["format"], H, I)
    nbytes = [len(set(c)) * per_expert for c in ids[WARMUP:]]
    t = row.pop("times_us")
    row["us"] = statistics.median(t)
    row["gbs"] = statistics.median(b / (u * 1e3) for b, u in zip(nbytes, t))
    row["distinct_experts"] = statistics.mean(len(set(c)) for c in ids[WARMUP:])
    row["reps"] = len(t)
    return row


def peer_rows(bench, row: dict, dims: tuple, ids: dict, max_wait: float, info: dict | None = None) -> list[dict]:
    """A peer's rows for one format and thread count (1 and 4 tokens), or one row saying why there are none.
    `bench(H, E, I, k, format, threads, ids, warmup)` runs it and returns its JSON; a str: why it did not run."""
    if isinstance(bench, str):
        return [{**row, "tokens": None, "error": bench}]
    print(f"{row['shape']} {row['format']}: {row['engine']} T={row['threads']} ...", file=sys.stderr)
    wait_quiet(max_wait)
    H, E, I, k = dims
    with Others() as others:
        out = bench(H, E, I, k, row["format"], row["threads"], ids, WARMUP)
    if "error" in out:
        return [{**row, "tokens": None, "error": out["error"]}]
    if info is not None and "variant" in out:
        info["variant"] = out["variant"]
    extra = {"load_s": out["load_s"]} if "load_s" in out else {}
    return [summarize({**row, "tokens": r["tokens"], "times_us": r["times_us"], **extra, "others": others.share},
                      H, I, ids[r["tokens"]]) for r in out["rows"]]


def run(args) -> dict:
    threads = [1] if args.quick else [1, 2]
    shapes = {n: s for n, s in SHAPES.items() if not args.quick or n == "Qwen3-30B-A3B"}
    reps = args.reps or (10 if args.quick else 40)
    from moe_offload.kernels import best_isa

    res = {"machine": machine(), "isa": best_isa().name, "load_start": loadavg(), "reps": reps, "rows": [],
           "kt": None, "shapes": {n: dict(zip(("H", "experts", "I", "top_k"), s)) for n, s in shapes.items()}}
    print(f"load average {res['load_start']}; measuring read bandwidth ...", file=sys.stderr)
    bw = {}
    bandwidth(threads, bw, args.max_wait)
    py, why = (None, "--no-kt") if args.no_kt else kt.ensure_kt(torch.__version__)
    if py:
        ver = subprocess.run([str(py), "-c", "import importlib.metadata as m; print(m.version('kt-kernel'))"],
                             capture_output=True, text=True).stdout.strip()
        res["kt"] = {"version": ver, "venv": str(kt.KT_VENV)}
    binary, gwhy, res["llama_cpp"] = (None, "--no-llama", {}) if args.no_llama else gg.ensure_ggml()
    llama_eng = f"llama.cpp {res['llama_cpp'].get('version', '')} (ggml)"
    for si, (name, (H, E, I, k, fmts)) in enumerate(shapes.items()):
        ids = {S: draw_ids(E, k, S, reps + WARMUP, seed=100 * si + S) for S in (1, 4)}
        for fmt in fmts:
            print(f"{name} {fmt}: ours ...", file=sys.stderr)
            for row in bench_ours(H, E, I, k, fmt, threads, ids, args.max_wait):
                res["rows"].append(summarize({"shape": name, "format": fmt, **row}, H, I, ids[row["tokens"]]))
        for (gname, ours), gfmts in GGML.items():
            if gname != name or ours not in fmts:
                continue
            for fmt in gfmts[:1] if args.quick else gfmts:
                bench = gwhy if binary is None else (lambda *a: gg.bench_ggml(binary, *a))
                for T in threads:
                    res["rows"] += peer_rows(bench, dict(shape=name, format=fmt, threads=T, engine=llama_eng,
                                                         against=ours if fmt == gfmts[0] else None),
                                             (H, E, I, k), ids, args.max_wait)
        for (kname, fmt), classes in KT.items():
            if args.no_kt or kname != name or args.quick and fmt not in fmts:
                continue
            for cls in classes[:1] if args.quick else classes:
                eng = f"kt-kernel {cls}" + " (llamafile)" * (cls == "MOE")
                bench = why if py is None else (
                    lambda H, E, I, k, f, T, ids, w, c=cls: kt.bench_kt(py, H, E, I, k, f, c, T, ids, w))
                for T in threads:
                    res["rows"] += peer_rows(bench, dict(shape=name, format=fmt, threads=T, engine=eng), (H, E, I, k),
                                             ids, args.max_wait, res["kt"])
        bandwidth(threads, bw, args.max_wait)   # again after each shape: the best sample is the machine's speed
    res["bandwidth"] = {T: {"best": max(w.values()), "way": max(w, key=w.get), "ways": w} for T, w in bw.items()}
    for r in res["rows"]:
        if "us" not in r:
            continue
        r["pct_bw"] = 100 * r["gbs"] / res["bandwidth"][r["threads"]]["best"]
        peers = [p["us"] for p in res["rows"] if p["engine"].startswith("kt") and "us" in p and
                 (p["shape"], p["format"], p["tokens"], p["threads"]) == (r["shape"], r["format"], r["tokens"],
                                                                          r["threads"])]
        if r["engine"] == "ours" and peers:
            r["x_kt"] = min(peers) / r["us"]
        llama = [p["us"] for p in res["rows"] if p["engine"].startswith("llama.cpp") and "us" in p and
                 (p["shape"], p["against"], p["tokens"], p["threads"]) == (r["shape"], r["format"], r["tokens"],
                                                                           r["threads"])]
        if r["engine"] == "ours" and llama:
            r["x_llama"] = llama[0] / r["us"]
    res["load_end"] = loadavg()
    return res


# --- reports ------------------------------------------------------------------------------------------------------

COLUMNS = ["shape", "format", "tokens", "threads", "engine", "us", "GB/s", "% of bandwidth", "x kt-kernel same format",
           "x llama.cpp", "others' CPU"]


def cells(r: dict) -> list[str]:
    fmt = r["format"] + (f" ({EXTRA[r['format']]}: other format)" if r["format"] in EXTRA else "")
    if "error" in r:
        return [r["shape"], fmt, "1, 4", str(r["threads"]), r["engine"], "-", "-", "-", f"did not run: {r['error']}",
                "", ""]
    return [r["shape"], fmt, str(r["tokens"]), str(r["threads"]), r["engine"], f"{r['us']:.0f}", f"{r['gbs']:.1f}",
            f"{r['pct_bw']:.0f}%", f"{r['x_kt']:.2f}x" if "x_kt" in r else "",
            f"{r['x_llama']:.2f}x" if "x_llama" in r else "", f"{r['others']:.0%}"]


def markdown(res: dict) -> str:
    m, ktinfo, llama = res["machine"], res["kt"] or {}, res.get("llama_cpp") or {}
    lines = ["# Kernel bench: one MoE layer's routed experts, ours against memory speed, llama.cpp and kt-kernel", "",
             "Written by `benchmarks/kernel_bench.py` (its docstring is the method in full).", "",
             f"- Machine: {m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB; torch {m['torch']}, Python "
             f"{m['python']}; our kernels' ISA path: {res['isa']}; tree {m['tree']}; {m['date']}.",
             f"- kt-kernel: {ktinfo.get('version', 'not run')} (extension variant {ktinfo.get('variant', '-')}), in "
             "its own venv, driven through its extension classes (`benchmarks/kernel_bench_kt.py`). Its pool pins "
             "its T compute threads to cores 0..T-1 while its task-queue thread and the submitting thread spin "
             "(`sync`): at 2 threads on this 2-core machine that is 4 busy threads on 2 cores, and its times land on "
             "multiples of the 4 ms scheduler tick.",
             f"- Load average (1, 5, 15 min) at the start: {res['load_start']}; at the end: {res['load_end']}. Each "
             "row waited (up to --max-wait s) for other processes to use under 10% of the CPUs; \"others' CPU\" "
             "is their share of the machine's CPU time while the row was measured (/proc/stat less this process "
             "and its children): a row above ~10% shared its cores and is slower than the kernel alone.",
             f"- Measured read bandwidth (a 2 GiB buffer read once by a torch reduction; best of 5 calls, of "
             f"{len(res['shapes']) + 1} samples (at the start and after each shape) and of the ways tried): "
             + "; ".join(f"{T} thread{'s' if T > 1 else ''}: {b['best']:.1f} GB/s ({b['way']}; " + ", ".join(
                 f"{w} {v:.1f}" for w, v in b["ways"].items()) + ")" for T, b in res["bandwidth"].items()) + ".",
             f"- Each row: median of {res['reps']} calls after {WARMUP} warm-up calls, fresh random expert ids "
             "per call (each token's top-k drawn on its own; the same ids for every engine). Ours = gate_up "
             "kernel, SiLU(gate) * up in torch, down kernel, routing-weighted sum in torch; kt-kernel's forward "
             "does the same work in one call (submit + sync on its CPUInfer, as its wrappers do).",
             "- GB/s = distinct selected experts x 3*H*I weights x bytes per weight (bf16 2, FP8 1 + block "
             "scales, MXFP4 17/32; the extra formats their nominal size) / time. x kt-kernel = the fastest "
             "kt-kernel class's time for the same shape, format, tokens and threads / ours.",
             f"- llama.cpp: {llama.get('version', 'not run')} (commit {str(llama.get('commit'))[:7]}), its ggml CPU "
             "kernels as `make engines` built them, driven by `benchmarks/ggml_layer.cpp` (the graph llama.cpp "
             "builds for this FFN at decode: mul_mat_id gate and up, swiglu, mul_mat_id down, routing weights, sum; "
             "one persistent thread pool, each ggml_graph_compute call timed). x llama.cpp = llama.cpp's time for "
             "the same format / ours: bf16 and MXFP4 are the same bytes; our FP8 is compared with Q8_0, llama.cpp's "
             "8-bit format (it has no FP8; 34 bytes per 32 weights); Q4_0 is an extra row.", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cells(r)) + " |" for r in res["rows"]]
    return "\n".join(lines) + "\n"


def rich_table(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="one MoE layer's routed experts (kernel_bench)")
    for c in COLUMNS:
        t.add_column(c, justify="right" if c in ("us", "GB/s", "% of bandwidth", "tokens", "threads") else "left")
    for r in res["rows"]:
        t.add_row(*cells(r))
    Console(width=200).print(t)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    threads = sorted(res["bandwidth"])
    fig, axes = plt.subplots(len(threads), 1, figsize=(14, 4.5 * len(threads)), squeeze=False)
    for ax, T in zip(axes[:, 0], threads):
        rows = [r for r in res["rows"] if r["threads"] == T and "us" in r]
        groups = list(dict.fromkeys((r["shape"], r["format"], r["tokens"]) for r in rows))
        engines = list(dict.fromkeys(r["engine"] for r in res["rows"]))
        colors = {e: f"C{i % 10}" for i, e in enumerate(engines)}
        seen = set()
        for i, g in enumerate(groups):
            hit = [r for r in rows if (r["shape"], r["format"], r["tokens"]) == g]
            width = 0.8 / len(hit)
            for j, r in enumerate(hit):
                ax.bar(i + (j - (len(hit) - 1) / 2) * width, r["gbs"], width, color=colors[r["engine"]],
                       label=None if r["engine"] in seen else r["engine"])
                seen.add(r["engine"])
        ax.axhline(res["bandwidth"][T]["best"], color="k", ls="--", label="measured read bandwidth")
        ax.set_ylim(0, 1.4 * max([res["bandwidth"][T]["best"]] + [r["gbs"] for r in rows]))
        ax.set_xticks(range(len(groups)), [f"{s}\n{f}, {n} tok" for s, f, n in groups], fontsize=7, rotation=30,
                      ha="right")
        ax.set_ylabel("GB/s of expert bytes read")
        ax.set_title(f"{T} thread{'s' if T > 1 else ''}")
        ax.legend(fontsize=7, ncol=4, loc="upper right")
    fig.suptitle("One MoE layer's routed experts, decode (kernel_bench.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="Qwen3-30B-A3B, 1 thread, 10 reps; bench-out/ only")
    ap.add_argument("--no-kt", action="store_true", help="skip kt-kernel")
    ap.add_argument("--no-llama", action="store_true", help="skip llama.cpp's kernels (built once from make engines' "
                    "sources)")
    ap.add_argument("--reps", type=int, default=0, help="measured calls per row (default 40; --quick 10)")
    ap.add_argument("--max-wait", type=float, default=120, help="s to wait for other work to stop before each row")
    args = ap.parse_args(argv)
    res = run(args)
    rich_table(res)
    outs = [ROOT / "bench-out"] + ([] if args.quick else [ROOT / "docs"])
    for d in outs:
        d.mkdir(exist_ok=True)
        (d / "kernel_bench.md").write_text(markdown(res))
        (d / "kernel_bench.json").write_text(json.dumps(res, indent=1) + "\n")
        plot(res, d / "kernel-bench.png")
    print(f"wrote {', '.join(str(d / 'kernel_bench.md') for d in outs)} (+ .json, kernel-bench.png)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
