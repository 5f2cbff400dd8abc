"""Bigger than memory at released dimensions (issue 28's Measure): the disk tier against llama.cpp's mmap.

Qwen3-30B-A3B's layer x 8 (make-tiny --like, 10.4 GiB bf16, random weights, per-expert keys as released) or
gpt-oss-20b's x 12 (`--model gpt-oss-20b`: 7.5 GiB, its experts MXFP4 as released, read as stored) in v1 memory cgroups of 55% and 35% of the checkpoint, each arm a fresh process on a cold page cache, at one and two
threads: ours (a) the disk tier, (b) + host cache, (c) + host cache + look-ahead 1, (d) the disk tier's reads
through mmap, (b0) = (b) planned without routing statistics, (bc) = (b) with the decode step compiled, against (e)
llama.cpp memory-mapped (its default; `--load-mode dio` where the build has it). Every
arm's --device-memory is the cgroup's limit: the whole process (interpreter, torch, weights, buffers, caches and the
page cache it causes) must stay inside it. (b) and (c) move part of the plan's resident experts to the host cache:
the same memory in all. Beside every figure: the disk's measured random-read bandwidth (O_DIRECT, reads of one
expert's bytes, one and four in flight) and the floor, the bytes the arm read per token over the better of the two.
The model fully resident (no limit), its decode step eager and compiled, gives the compute floor (the faster).
Needs root (cgroups, drop_caches) and `make engines`.

Writes docs/released_disk_bench.{json,md} and docs/released-disk-bench.png (gpt-oss-20b: released_disk_gpt_oss_bench / -gpt-oss;
--quick: bench-out/ only).

    .venv/bin/python benchmarks/released_disk_bench.py [--model qwen3-30b-a3b|gpt-oss-20b] [--quick] [--no-llama]
        [--report-only JSON]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import moe_offload as mo
from lookahead_bench_arms import GiB, ROOT, cold_bandwidth, run_ours, run_llama
from moe_offload.loading.loader import load_tokenizer
from released_bench import ensure_model
from step_bench import write_reports
from step_bench_peers import engines, machine as peers_machine
from rich.console import Console
from rich.table import Table

console = Console(highlight=False, width=170)
# --model: (folder under models/released, make-tiny arguments, what it is, report name suffix)
MODELS = {"qwen3-30b-a3b": ("qwen3-30b-a3b-8L", ["--like", "qwen3-30b-a3b", "--layers", "8"],
                            "Qwen3-30B-A3B's layer x 8, bf16", ""),
          "gpt-oss-20b": ("gpt-oss-20b-12L", ["--like", "gpt-oss-20b", "--layers", "12"],
                          "gpt-oss-20b's layer x 12, experts MXFP4 as released, the rest bf16", "gpt_oss")}
PROMPT = ("The history of the river valley begins with the first farmers, who cleared the forest along its banks "
          "and planted wheat and barley in the rich soil that the floods left behind each spring.")
FULL = dict(caps=(0.55, 0.35), threads=(1, 2), steps=32, reserve_gb=1.25, cache_share=0.5,
            workloads=("greedy", "sampled"))
QUICK = dict(FULL, caps=(0.55,), threads=(1,), steps=8, workloads=("sampled",))
GPT_OSS = dict(workloads=("sampled",), b0=False)
# How each step's token is chosen, by both engines. greedy: the model's argmax (a random-weight model soon repeats
# one token, so each layer picks nearly the same experts every step: the working set is one token's experts);
# sampled: drawn from the softmax at temperature 1 with a fixed seed (every step a new token, routing spread as a
# long real generation spreads it).
WORKLOADS = {"greedy": (dict(greedy=True), ("--temp", "0")),
             "sampled": (dict(sample={"temperature": 1.0, "seed": 0}),
                         ("--temp", "1", "--top-k", "0", "--top-p", "1", "--min-p", "0"))}
GOAL_LLAMA, GOAL_FLOOR = 1.2, 1.3
# llama.cpp repacks weights for its CPU kernels where the CPU has a layout for them (AMX, MXFP4, ...): a copy in
# anonymous memory, the whole model's, which no cap below the model holds (OOM-killed at load). --no-repack keeps
# the weights where its mmap put them: the page cache, as llama.cpp's memory-mapped mode means.
LLAMA_OPTIONS = ("--no-repack",)
# The routing statistics our plans are made with (the frequency policy): recorded once, resident, on another text
# with another seed than the measured runs, as a user records a trace of their own prompts before planning.
CALIBRATION = ("Rain fell on the harbour town all night; by morning the fishing boats rocked at their moorings while "
               "the market opened under canvas and the baker counted loaves for the ferry crews.")


def arm_specs(cfg: dict, model: Path, ids: list[int], cap_gb: float, threads: int,
              workload: str = "greedy", stats: dict | None = None) -> list[dict]:
    """(a)-(d) at one cap and thread count, planned with the routing statistics `stats` (the frequency policy:
    the experts RAM holds are those the calibration picked most), and (b0): (b) planned without them. The host
    cache takes cache_share of the experts the plan keeps resident, out of the same --device-memory (its reserve
    grows by as much; CPU-only, the host cache lives in the reserve)."""
    r = cfg["reserve_gb"]
    plan = mo.plan(model, device_memory_gb=cap_gb, reserve_gb=r)
    resident_experts = sum(t.bytes for t in plan.tensors if t.role == "routed_expert" and t.tier == "device")
    h = round(cfg["cache_share"] * resident_experts / GiB, 2)
    tag = f"{workload}-{round(cap_gb * 100 / cfg['total_gib'])}-{threads}t"
    common = dict(model=str(model), ids=ids, prefill=len(ids), steps=cfg["steps"], threads=threads,
                  budget_gb=cap_gb, experts="auto", **WORKLOADS[workload][0])
    cached = dict(common, reserve_gb=r + h, host_cache_gb=h)
    planned = dict(stats=stats) if stats else {}
    specs = [dict(common, key="a", label="(a) disk tier", reserve_gb=r, **planned),
             dict(cached, key="b", label=f"(b) + host cache {h:g} GiB", **planned),
             dict(cached, key="c", label=f"(c) + host cache {h:g} GiB + lookahead 1", lookahead=1, **planned),
             dict(common, key="d", label="(d) disk reads via mmap", reserve_gb=r, disk_read="mmap", **planned)]
    if stats and cfg.get("b0", True):
        specs.append(dict(cached, key="b0", label=f"(b0) = (b) planned without routing statistics"))
    if cfg.get("compiled", True):
        specs.append(dict(cached, key="bc", label="(bc) = (b), the decode step compiled", compile=True, **planned))
    return [dict(s, arm=s["key"], key=f"{s['key']}-{tag}") for s in specs]


def calibrate(cfg: dict, model: Path, logdir: Path) -> dict:
    """Routing statistics for the frequency plans: the model resident (no limit), prefilled with CALIBRATION and
    decoding cfg['steps'] sampled tokens (seed 1; the measured runs use seed 0 and PROMPT): layer -> picks per
    expert over those decode tokens (what traces.expert_counts makes of a recorded trace)."""
    ids = load_tokenizer(model)(CALIBRATION)["input_ids"]
    spec = dict(arm_specs(cfg, model, ids, cfg["total_gib"], max(cfg["threads"]), "sampled")[0], arm="resident",
                key="calibration", label="calibration", sample={"temperature": 1.0, "seed": 1})
    row = run_ours(spec, None, logdir)
    if "error" in row:
        raise SystemExit(f"error: the calibration run failed ({row['error']}): {row.get('stderr_tail', '')[-600:]}")
    counts: dict[int, list[int]] = {}
    for step in row["routed"]:
        for layer, experts in step.items():
            c = counts.setdefault(int(layer), [0] * cfg["num_experts"])
            for e in experts:
                c[e] += 1
    console.print("calibration: distinct experts per layer over its decode tokens: "
                  + ", ".join(str(sum(1 for n in c if n)) for _, c in sorted(counts.items())))
    return {"prompt": CALIBRATION, "tokens": len(row["routed"]), "seed": 1, "stats": counts,
            "distinct_experts_per_layer": {str(k): sum(1 for n in c if n) for k, c in sorted(counts.items())}}


def llama_dio(where: dict) -> bool:
    """Whether this llama.cpp build takes --load-mode dio (newer builds read the GGUF with O_DIRECT then)."""
    import subprocess

    out = subprocess.run([where["completion"], "--help"], capture_output=True, text=True, timeout=60)
    return "--load-mode" in out.stdout + out.stderr


def derive(res: dict) -> None:
    """Floors, ratios and goals, added to the rows and to res['goals']."""
    bw = max(res["random_bytes_per_s"], res["random_4_in_flight_bytes_per_s"])
    llama = {(r.get("workload", "greedy"), r["cap"], r["threads"]): r for r in res["rows"]
             if r["arm"].startswith("(e)") and "error" not in r}
    compute = compute_floor(res)
    goals = []
    for r in res["rows"]:
        if "error" in r:
            continue
        r["ms_per_token"] = 1e3 / r["tok_s_mean"]
        r["disk_floor_ms"] = r["proc_io_read_bytes_per_token"] / bw * 1e3
        r["floor_ms"] = max(r["disk_floor_ms"], 1e3 * compute.get(str(r["threads"]), compute.get(r["threads"], 0)))
        r["vs_floor"] = r["ms_per_token"] / r["floor_ms"] if r["floor_ms"] else None
        peer = llama.get((r.get("workload", "greedy"), r["cap"], r["threads"]))
        r["vs_llama"] = r["tok_s_mean"] / peer["tok_s_mean"] if peer else None
    for w, cap, t in _groups(res):
        ours = [r for r in res["rows"] if (r.get("workload", "greedy"), r["cap"], r["threads"]) == (w, cap, t)
                and not r["arm"].startswith("(e)")]
        inside = [r for r in ours if "error" not in r and not r.get("cgroup_oom_kills")]
        goals.append((f"{w}, {cap:.0%}, {t} thread(s): every arm of ours inside its cgroup", len(inside) == len(ours),
                      ", ".join(f"{r['arm'].split(' ')[0]} " + (f"{r['cgroup_max_usage_bytes'] / GiB:.2f} GiB"
                                if "cgroup_max_usage_bytes" in r else r.get("error", "?")) for r in ours)))
        if not inside:
            continue
        best = max(inside, key=lambda r: r["tok_s_mean"])
        if best.get("vs_llama") is not None:
            goals.append((f"{w}, {cap:.0%}, {t} thread(s): ours >= {GOAL_LLAMA}x llama.cpp mmap",
                          best["vs_llama"] >= GOAL_LLAMA, f"{best['arm']} {best['tok_s_mean']:.2f} tok/s = "
                          f"{best['vs_llama']:.2f}x"))
        goals.append((f"{w}, {cap:.0%}, {t} thread(s): ours within {GOAL_FLOOR}x of the floor of the bytes it reads",
                      best["vs_floor"] <= GOAL_FLOOR, f"{best['arm']} {best['ms_per_token']:.0f} ms/token vs "
                      f"floor {best['floor_ms']:.0f} ms = {best['vs_floor']:.2f}x"))
    res["goals"] = goals
    res["compute_floor_ms"] = {str(t): v * 1e3 for t, v in compute.items()}


def compute_floor(res: dict) -> dict[str, float]:
    """threads -> seconds a token: the resident (no limit) decode step, the faster of its eager and compiled runs
    (a JSON from before the compiled run: the eager one)."""
    floor = {}
    for runs in (res["resident"], res.get("resident_compiled", {})):
        for t, r in runs.items():
            if "error" not in r:
                floor[t] = min(floor.get(t, math.inf), statistics.mean(r["itl_s"]))
    return floor


def _groups(res: dict) -> list[tuple[str, float, int]]:
    """(workload, cap, threads) of every measured group, in the order run (a JSON from before workloads: greedy)."""
    cfg = res["config"]
    return [(w, c, t) for w in cfg.get("workloads", ("greedy",)) for c in cfg["caps"] for t in cfg["threads"]]


def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def report(res: dict) -> str:
    derive(res)
    bw1, bw4 = res["random_bytes_per_s"], res["random_4_in_flight_bytes_per_s"]
    md = [f"# Bigger than memory at released dimensions: {res['model']} against llama.cpp's mmap", "",
          f"{res['model']}: {res['total_bytes'] / GiB:.2f} GiB ({res.get('what', MODELS['qwen3-30b-a3b'][2])}, random "
          f"weights). Machine: "
          f"{res['machine']}. llama.cpp {res['llama_version']}. Cold page cache before every run; each arm a fresh "
          f"process in a v1 memory cgroup of the cap (RSS and page cache charged), --device-memory = the cap, "
          f"--reserve-gb {res['config']['reserve_gb']} (+ the host cache in (b), (c), (b0), (bc)); {res['config']['steps']} "
          f"decode tokens after a {res['prompt_tokens']}-token prompt (the same text for both engines; ours "
          "computes experts with its CPU kernels, `--experts auto`), each token chosen as the workload says: "
          "greedy (the argmax: a random-weight model soon repeats one token, so every step routes nearly as the "
          "last and the working set is one token's experts) or sampled (drawn from the softmax at temperature 1, "
          "fixed seed; llama.cpp `--temp 1 --top-k 0 --top-p 1 --min-p 0`: a new token every step, routing "
          "spread as a long generation spreads it).", "",
          f"Disk (the checkpoint's own files, O_DIRECT, random reads of {res['read_block'] / 2**20:.0f} MiB, one "
          f"expert's bytes): {bw1 / 1e9:.2f} GB/s one at a time, {bw4 / 1e9:.2f} GB/s four in flight. Floor: the "
          "bytes an arm read per token (/proc/self/io; llama.cpp: the difference of two runs) over the better of the "
          "two, or the compute floor (resident, no limit"
          + (", the faster of its eager and compiled decode steps" if res.get("resident_compiled") else "") + ": "
          + ", ".join(
              f"{v:.0f} ms at {t} thread(s)" for t, v in res["compute_floor_ms"].items()) + ") where higher.", ""]
    cols = ("workload", "cap", "threads", "arm", "tok/s", "x llama.cpp", "disk MB/token", "floor ms", "x floor", "cgroup peak GiB",
            "host-cache hit rate")
    table = Table(*cols, title="decode")
    md += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in res["rows"]:
        if "error" in r:
            cells = (r.get("workload", "greedy"), f"{r['cap']:.0%}", str(r["threads"]), r["arm"], r["error"],
                     "", "", "", "", "", "")
        else:
            looked = r.get("host_cache_hits", 0) + r.get("host_cache_misses", 0)
            cells = (r.get("workload", "greedy"), f"{r['cap']:.0%} ({r['cap_gb']:.2f} GiB)", str(r["threads"]), r["arm"], _f(r["tok_s_mean"]),
                     _f(r.get("vs_llama")), _f(r["proc_io_read_bytes_per_token"] / 1e6, "{:.0f}"),
                     _f(r["floor_ms"], "{:.0f}"), _f(r["vs_floor"]), _f(r.get("cgroup_max_usage_bytes", 0) / GiB),
                     _f(r["host_cache_hits"] / looked if looked else None))
        table.add_row(*cells)
        md.append("| " + " | ".join(cells) + " |")
    console.print(table)
    md += ["", "## Goals (issue 28)", ""]
    for name, ok, how in res["goals"]:
        md.append(f"- {'met' if ok else 'MISSED'}: {name}: {how}")
        console.print(f"{'met   ' if ok else 'MISSED'} {name}: {how}")
    cal = res.get("calibration")
    md += ["", "## Method", "", "`.venv/bin/python benchmarks/released_disk_bench.py` (in `make bench`). Ours: "
           "benchmarks/lookahead_bench_arms.py's child (load with the plan of `--device-memory CAP --reserve-gb R`, "
           "host-tier placements read from disk as on a CPU, prefill, then one timed forward per token: its decode, "
           "as llama.cpp's eval time counts it; choosing the token, which llama.cpp counts apart as its sampling "
           "time, is in the JSON's choose_ms_per_token)"
           + (f"; (a)-(d) planned by the frequency policy from routing statistics recorded once beforehand, the "
              f"model resident, on another text ({cal['tokens']} sampled decode tokens, seed {cal['seed']}; distinct "
              f"experts per layer: {', '.join(map(str, cal['distinct_experts_per_layer'].values()))}), (b0) by the default "
              "policy without them" if cal else "") + "; (bc) decodes through the compiled step (run/compiled.py: "
           "transformers' compiled call over a static KV cache, each layer's streamed experts one operator node of "
           "its graph, as `--compile` decodes), after one more decode step, which compiles and is not measured "
           "(compile_s in the JSON); llama.cpp: "
           "`llama-completion -n N --ignore-eos -t T -tb T -c 512 --no-repack` (its repacked copy of the weights, anonymous "
           "memory, does not fit a cap below the model), its eval time over its eval runs. The disk MB per "
           "token of ours is what the process read from the block device (/proc/self/io) over the decode steps.", ""]
    md += [f"- {note}" for note in res.get("notes", [])]
    return "\n".join(md) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _groups(res)
    per_row = len(res["config"]["caps"]) * len(res["config"]["threads"])
    lines = -(-len(groups) // per_row)
    fig, axes = plt.subplots(lines, per_row, figsize=(4.6 * per_row, 4.4 * lines), squeeze=False)
    for ax, (w, cap, t) in zip(axes.flat, groups):
        rows = [r for r in res["rows"] if (r.get("workload", "greedy"), r["cap"], r["threads"]) == (w, cap, t)]
        if not rows:
            continue
        names = [r["arm"].split(" ", 1)[0] for r in rows]
        speeds = [r.get("tok_s_mean") or 0 for r in rows]
        colours = ["tab:orange" if n.startswith("(e") else "tab:blue" for n in names]
        ax.bar_label(ax.bar(names, speeds, color=colours), fmt="%.2f", fontsize=8)
        ax.scatter(names, [1e3 / r["floor_ms"] if r.get("floor_ms") else 0 for r in rows], color="tab:red",
                   marker="_", s=300, zorder=3, label="floor (bytes read / disk bandwidth)")
        ax.set(title=f"{w}: cap {cap:.0%} ({rows[0]['cap_gb']:.2f} GiB), {t} thread(s)", ylabel="decode tokens / s")
        ax.legend(fontsize=7)
    fig.suptitle(f"{res['model']} ({res['total_bytes'] / GiB:.1f} GiB) in memory cgroups, cold cache; "
                 f"ours blue, llama.cpp {res['llama_version']} mmap orange")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(res: dict, out: Path, docs: Path | None) -> int:
    res.setdefault("wall_s", res["elapsed_s"])
    suffix = res.get("suffix", "")
    write_reports(f"released_disk_{suffix}_bench" if suffix else "released_disk_bench",
                  "released-disk-bench" + (f"-{suffix.replace('_', '-')}" if suffix else "") + ".png", res,
                  report(res), plot, out, docs)
    return 0


def machine(peers: dict) -> str:
    """step_bench_peers.machine's CPU and cores, with the RAM and the kernel."""
    m = peers_machine(peers)
    return f"{m['cpu']}, {m['cores']} cores, {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / GiB:.0f} " \
           f"GiB, {platform.system()} {platform.release()}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one cap, one thread, 8 tokens: the pipeline end to end")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen3-30b-a3b")
    ap.add_argument("--work", type=Path, default=ROOT / "models" / "released")
    ap.add_argument("--report-only", type=Path, help="rewrite the md and the plot from a JSON this script wrote")
    args = ap.parse_args(argv)
    if args.report_only:
        return write(json.loads(args.report_only.read_text()), args.report_only.parent, None)
    cfg = dict(QUICK if args.quick else FULL)
    if args.model == "gpt-oss-20b" and not args.quick:   # its arms take twice as long (a prefill of MXFP4 experts
        cfg.update(GPT_OSS)                              # dequantized into GEMMs): the sampled workload, (a)-(d)
    began = time.perf_counter()
    folder, make_args, what, suffix = MODELS[args.model]
    model = ensure_model(args.work / folder, make_args)
    full = mo.plan(model, offload_gb=0)
    cfg["total_gib"] = full.total_bytes / GiB
    config = json.loads((model / "config.json").read_text())
    cfg["num_experts"] = config.get("num_experts") or config["num_local_experts"]
    first = [t for t in full.tensors if t.role == "routed_expert"]
    block = sum(t.bytes // t.shape[0] for t in first if t.layer == first[0].layer)   # one expert, every tensor,
    block = -(-block // 4096) * 4096                                                 # in whole O_DIRECT blocks
    ids = load_tokenizer(model)(PROMPT)["input_ids"]      # the whole prompt, as llama.cpp is given it
    logdir = ROOT / "bench-out" / f"released-disk-bench-logs{'-' + suffix if suffix else ''}"
    logdir.mkdir(parents=True, exist_ok=True)
    peers = engines()
    where = peers["llama_cpp"]
    bw = [cold_bandwidth(model, block, GiB)]
    rows, resident, resident_compiled = [], {}, {}
    for t in cfg["threads"]:     # the compute floor: the model resident, its decode step eager and compiled
        spec = dict(arm_specs(cfg, model, ids, cfg["total_gib"], t)[0], arm="resident", key=f"resident-{t}t",
                    label="resident (no limit)")
        for into, extra, how in ((resident, {}, "eager"), (resident_compiled, dict(compile=True), "compiled")):
            into[str(t)] = run_ours(dict(spec, **extra, key=spec["key"] + ("-compiled" if extra else "")), None,
                                    logdir)
            console.print(f"resident, {t} thread(s), {how}: " + into[str(t)].get("error", "")
                          + _f(into[str(t)].get("tok_s_mean")) + " tok/s")
    calibration = calibrate(cfg, model, logdir)
    stats = calibration.pop("stats")
    for w, cap, t in _groups({"config": cfg}):
        cap_gb = round(cap * cfg["total_gib"], 2)
        limit = int(cap_gb * GiB)
        where_ = dict(workload=w, cap=cap, cap_gb=cap_gb, threads=t)
        for spec in arm_specs(cfg, model, ids, cap_gb, t, w, stats):
            row = run_ours(spec, limit, logdir)
            rows.append({**row, **where_, "arm": spec["label"]})
            console.print(f"{w} {cap:.0%} {t}t {spec['label']}: " + (row.get("error") or f"{row['tok_s_mean']:.2f} tok/s"))
        if args.no_llama:
            continue
        row = run_llama(model, PROMPT, cfg["steps"], limit, logdir, t, WORKLOADS[w][1], f"-{w}", LLAMA_OPTIONS)
        rows.append({**row, **where_})
        console.print(f"{w} {cap:.0%} {t}t llama.cpp: " + (row.get("error") or f"{row['tok_s_mean']:.2f} tok/s"))
    bw.append(cold_bandwidth(model, block, GiB))
    res = {"config": cfg, "model": model.name, "what": what, "suffix": suffix, "prompt_tokens": len(ids), "total_bytes": full.total_bytes, "read_block": block, "disk": bw,
           "random_bytes_per_s": statistics.mean(b["random_bytes_per_s"] for b in bw),
           "random_4_in_flight_bytes_per_s": statistics.mean(b["random_4_in_flight_bytes_per_s"] for b in bw),
           "machine": machine(peers), "llama_version": where.get("version", "?"),
           "llama_load_mode_dio": llama_dio(where) if where.get("ok") else None,
           "resident": resident, "resident_compiled": resident_compiled, "calibration": calibration, "rows": rows,
           "elapsed_s": time.perf_counter() - began}
    console.print(f"done in {res['elapsed_s']:.0f} s")
    return write(res, ROOT / "bench-out", None if args.quick else ROOT / "docs")


if __name__ == "__main__":
    sys.exit(main())
