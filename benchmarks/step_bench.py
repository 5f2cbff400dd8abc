"""A decode step that costs what its work costs: moe-offload's decode tok/s against llama.cpp and vLLM CPU (issue 17).

The same make-tiny qwen3_moe models (random weights, bf16, head_dim 128; made once under models/step-bench/, or
--work DIR), greedy, the same prompt token ids, page cache warm, on this machine's CPUs:

- A "qwen3-30b-shaped": 4 layers, 128 experts top-8, hidden 512 (expert width 768 = Qwen3-30B-A3B's
  moe_intermediate_size); B: 8 layers, 64 experts top-4, hidden 512; C "large matrices": 10 layers, 32
  experts top-2, hidden 1536 (6.5 GiB; only with --full). Threads 1 and 2.
- moe-offload arms: experts eager / grouped / grouped + compiled decode step, each resident (offload_gb=0) and
  with half the routed-expert bytes offloaded (uva; on a CPU the host tier is ordinary memory, so this is the
  offload path's overhead). Each arm in a fresh process with an empty inductor cache of its own
  (run_child: a compiled arm twice, cold then warm cache): moe_offload.measure.timing.greedy_generate once
  to warm up (the compiled arm's warm-up gives compile_s), then 3 measured runs: tok/s = 1 / median
  inter-token latency over their steps; CPU ms/token (peers.cpu_per_token: what a step costs while others
  share the cores); link MiB/token from the runtime's counters.
- llama.cpp and vLLM: benchmarks/step_bench_peers.py.

    .venv/bin/python benchmarks/step_bench.py [--quick | --full] [--tokens 64] [--no-vllm] [--work DIR]

--quick: model A, 1 thread, 32 tokens (a smoke check; writes bench-out/ only). Otherwise bench-out/ and docs/
(step_bench.json, step_bench.md, step-bench.png).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import step_bench_peers as peers  # noqa: E402

COMMON = dict(family="qwen3_moe", dtype="bf16", head_dim=128)
MODELS = {   # label: (folder name, make_tiny sizes, kind)
    "A qwen3-30b-shaped": ("A-qwen3-30b-shaped", dict(layers=4, experts=128, top_k=8, hidden=512), "many-expert"),
    "B 64x4": ("B-64x4", dict(layers=8, experts=64, top_k=4, hidden=512), "many-expert"),
    "C large matrices": ("C-large-matrices", dict(layers=10, experts=32, top_k=2, hidden=1536, max_shard_size="1GB"),
                         "large-matrix"),
}
ARMS = {   # arm: (experts, half offloaded, compiled)
    "eager": ("eager", False, False), "eager half-off": ("eager", True, False),
    "grouped": ("grouped", False, False), "grouped half-off": ("grouped", True, False),
    "compiled": ("grouped", False, True), "compiled half-off": ("grouped", True, True),
    "fused": ("fused", False, False), "fused half-off": ("fused", True, False),
}
PROMPT = "The harbour master counted the boats"
GiB, MiB = 1 << 30, 1 << 20


def ensure_model(folder: Path, sizes: dict) -> Path:
    """The model, made once; a folder made with other sizes is refused rather than silently reused."""
    want = {**COMMON, **{k: v for k, v in sizes.items() if k != "max_shard_size"}}
    meta = folder / "moe_offload_tiny.json"
    if meta.is_file():
        have = json.loads(meta.read_text())
        wrong = {k: (have.get(k), v) for k, v in want.items() if k != "dtype" and have.get(k) != v}
        if wrong or have.get("dtype") != "bfloat16":
            raise SystemExit(f"{folder} exists with other sizes {wrong}: remove it or pass --work DIR")
        return folder
    from moe_offload.tiny.make import make_tiny

    print(f"making {folder.name} (once; cached) ...", file=sys.stderr)
    return make_tiny(folder, progress=True, **COMMON, **sizes)


# --- one moe-offload arm, in its own process -------------------------------------------------------------------

def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def child(folder: Path, arm: str, threads: int, tokens: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    import moe_offload as mo
    from moe_offload.loading.loader import load_tokenizer
    from moe_offload.measure.timing import greedy_generate, measured_link_bytes
    from moe_offload.run.compiled import compile_kwargs, compile_seconds

    experts, half, compiled = ARMS[arm]
    expert_bytes = mo.plan(folder, offload_gb=0).roles()["routed_expert"]["bytes"]
    offload_gb = expert_bytes / 2 / GiB if half else 0
    enc = load_tokenizer(folder)([PROMPT], return_tensors="pt")
    start = time.perf_counter()
    model, plan = mo.load(folder, device="cpu", experts=experts, offload_gb=offload_gb, backend="uva")
    load_s = time.perf_counter() - start
    cpu = torch.device("cpu")
    kwargs = compile_kwargs(model) if compiled else {}
    rt = model.moe_offload_runtime
    with torch.no_grad():
        warm = greedy_generate(model, enc, tokens, cpu, **kwargs)
        rt.counter.reset()
        rt.disk_counter.reset()
        runs, cpu_n, cpu_1 = [], [], []
        for _ in range(peers.REPS):
            c = cpu_s()
            runs.append(greedy_generate(model, enc, tokens, cpu, **kwargs))
            cpu_n.append(cpu_s() - c)
        link = measured_link_bytes(1, runs)
        for _ in range(peers.REPS):   # prefill alone, after the N-token runs (its static cache is another size)
            c = cpu_s()
            greedy_generate(model, enc, 1, cpu, **kwargs)
            cpu_1.append(cpu_s() - c)
    itl = [s for r in runs for s in r.itl_s]
    roles = plan.roles()
    return {"arm": arm, "engine": "moe-offload", "experts": experts, "half_offloaded": half, "compiled": compiled,
            "threads": threads, "tokens": tokens, "decode_steps": len(runs[0].itl_s), "runs": len(runs),
            "tok_s": 1 / statistics.median(itl), "tok_s_runs": [1 / statistics.median(r.itl_s) for r in runs],
            "itl_p50_ms": statistics.median(itl) * 1e3, "ttft_ms": runs[0].ttft_s * 1e3,
            "cpu_ms_per_token": peers.cpu_per_token(cpu_n, cpu_1, tokens),
            "compile_s": compile_seconds(warm.itl_s) if compiled else 0.0,
            "warmup_first_step_s": warm.itl_s[0] if warm.itl_s else None,
            "link_bytes_per_token": link, "offload_gb": offload_gb,
            "routed_expert_bytes": expert_bytes, "offloaded_expert_bytes": roles["routed_expert"]["offloaded_bytes"],
            "offloaded_bytes": sum(r["offloaded_bytes"] for r in roles.values()), "load_s": load_s,
            "mechanism": rt.mechanism, "prompt_ids": enc["input_ids"][0].tolist(),
            "token_ids": runs[0].token_ids[0, :16].tolist(), "torch_threads": torch.get_num_threads()}


def run_child(folder: Path, arm: str, threads: int, tokens: int) -> dict:
    """One arm in a fresh process with an empty inductor cache of its own. A compiled arm runs twice over that
    cache: the first process's compile_s is the cold figure, the second's (FX graph cache on disk warm, as
    for any later process on the machine) the warm one, and the second's timings make the row."""
    base = {"arm": arm, "engine": "moe-offload", "threads": threads, "tokens": tokens}
    with tempfile.TemporaryDirectory(prefix="step-bench-inductor-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": str(threads)}
        cmd = [sys.executable, __file__, "--child", arm, "--child-model", str(folder), "--threads", str(threads),
               "--tokens", str(tokens)]
        got = []
        for _ in range(2 if ARMS[arm][2] else 1):
            before = peers.loadavg()
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
            if out.returncode != 0:
                return dict(base, error=f"exit {out.returncode}: {out.stderr[-1500:]}")
            got.append(dict(json.loads(out.stdout.strip().splitlines()[-1]), loadavg_before=before,
                            loadavg_after=peers.loadavg()))
    row = got[-1]
    if len(got) == 2:
        row["compile_s_warm"], row["compile_s"] = row["compile_s"], got[0]["compile_s"]
        row["first_process"] = {k: got[0][k] for k in ("tok_s", "tok_s_runs", "cpu_ms_per_token", "token_ids")}
        row["loadavg_before"] = got[0]["loadavg_before"]
    return row


# --- the report ------------------------------------------------------------------------------------------------

def add_ratios(rows: list[dict]) -> None:
    """Each row against llama.cpp at the same model and threads: tok/s over its tok/s, and (the same sense, higher
    is better) llama.cpp's CPU ms per token over the row's."""
    llama = {(r["model"], r["threads"]): r for r in rows if r["arm"] == "llama.cpp" and r.get("tok_s")}
    for r in rows:
        ref = llama.get((r["model"], r["threads"]), {})
        r["vs_llama_cpp"] = r["tok_s"] / ref["tok_s"] if r.get("tok_s") and ref else None
        cpu, ref_cpu = r.get("cpu_ms_per_token"), ref.get("cpu_ms_per_token")
        r["vs_llama_cpp_cpu"] = ref_cpu / cpu if cpu and ref_cpu and cpu > 0 else None


def payback(compile_s: float, slow_tok_s: float | None, fast_tok_s: float | None) -> float | None:
    """Tokens after which compiling has paid for itself against decoding at slow_tok_s (inf: never)."""
    if not slow_tok_s or not fast_tok_s:
        return None
    saved = 1 / slow_tok_s - 1 / fast_tok_s
    return compile_s / saved if saved > 0 else float("inf")


def _x(v: float | None) -> str:
    return f"{v:.2f}x" if v else "-"


def goals(rows: list[dict], tokens: int, models: list[str]) -> list[dict]:
    """Issue 17's goals, each judged from this run's wall-clock tok/s (CPU-time ratios beside them)."""
    by = {(r["model"], r["threads"], r["arm"]): r for r in rows}
    out = []
    for (model, t) in dict.fromkeys((r["model"], r["threads"]) for r in rows):
        g = lambda arm: by.get((model, t, arm), {}).get("tok_s")   # noqa: E731
        kind = MODELS[model][2]
        res = [by[(model, t, a)] for a in ("eager", "grouped", "compiled") if (by.get((model, t, a)) or {}).get("vs_llama_cpp")]
        if res:
            best = max(res, key=lambda r: r["vs_llama_cpp"])
            need = 0.7 if kind == "many-expert" else 1.0
            out.append({"model": model, "threads": t, "goal": f"resident >= {need}x llama.cpp ({kind})",
                        "value": f"{best['vs_llama_cpp']:.2f}x ({best['arm']}); " + ", ".join(
                            f"{r['arm']} {_x(r['vs_llama_cpp'])} (CPU time {_x(r.get('vs_llama_cpp_cpu'))})" for r in res),
                        "met": best["vs_llama_cpp"] >= need})
        for base in ("eager", "grouped", "compiled"):
            if g(base) and g(f"{base} half-off"):
                ratio = g(f"{base} half-off") / g(base)
                cpu = [by[(model, t, a)].get("cpu_ms_per_token") for a in (base, f"{base} half-off")]
                extra = f" (CPU time {cpu[0] / cpu[1]:.2f}x)" if all(c and c > 0 for c in cpu) else ""
                out.append({"model": model, "threads": t, "goal": f"{base}: half offloaded within 10% of resident",
                            "value": f"{ratio:.2f}x resident{extra}", "met": ratio >= 0.9})
        for suffix in ("", " half-off"):
            c = by.get((model, t, "compiled" + suffix))
            if not c or not c.get("tok_s"):
                continue
            fmt = lambda n: "never" if n == float("inf") else "-" if n is None else f"{n:.0f}"   # noqa: E731
            paid = {}
            for when in ("cold", "warm"):
                cs = c.get("compile_s" if when == "cold" else "compile_s_warm")
                if cs is not None:
                    paid[when] = {base: payback(cs, g(base + suffix), c["tok_s"]) for base in ("grouped", "eager")}
            value = "; ".join(f"{when} compile_s {c['compile_s' if when == 'cold' else 'compile_s_warm']:.1f}: pays back "
                              f"after {fmt(vs['grouped'])} tokens vs grouped{suffix}, {fmt(vs['eager'])} vs eager{suffix}"
                              for when, vs in paid.items())
            n = paid.get("warm", paid.get("cold", {})).get("grouped")
            out.append({"model": model, "threads": t, "goal": f"compile{suffix} pays for itself within {tokens} tokens "
                        "(judged on the warm compile_s, against grouped uncompiled)", "value": value,
                        "met": n is not None and n <= tokens,
                        "payback_tokens": {w: {b: "never" if n == float("inf") else n for b, n in vs.items()}
                                           for w, vs in paid.items()}})
    if "C large matrices" not in models:
        out.append({"model": "C large matrices", "threads": None, "goal": "resident >= 1.0x llama.cpp (large-matrix)",
                    "value": "not measured (run with --full)", "met": None})
    return out


COLUMNS = ("model", "threads", "arm", "tok/s", "x llama.cpp", "CPU ms/token", "x llama.cpp (CPU)",
           "compile_s cold/warm", "link MiB/token")


def cells(r: dict) -> list[str]:
    if r.get("error"):
        return [r["model"], str(r["threads"]), r["arm"], "error", "", "", "", "", r["error"].strip().splitlines()[-1][:90]]
    comp = f"{r['compile_s']:.1f} / {r['compile_s_warm']:.1f}" if r.get("compiled") and "compile_s_warm" in r else ""
    cpu = f"{r['cpu_ms_per_token']:.2f}" if r.get("cpu_ms_per_token") is not None else ""
    link = f"{r['link_bytes_per_token'] / MiB:.2f}" if "link_bytes_per_token" in r else ""
    return [r["model"], str(r["threads"]), r["arm"], f"{r['tok_s']:.1f}", _x(r.get("vs_llama_cpp")), cpu,
            _x(r.get("vs_llama_cpp_cpu")), comp, link]


def print_table(rows: list[dict], checks: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, width=max(Console().width, 160))   # the table is wide
    t = Table(title="decode tok/s (batch 1, greedy)", title_justify="left")
    for c in COLUMNS:
        t.add_column(c, justify="left" if c in ("model", "arm") else "right", no_wrap=c in ("model", "arm"))
    for r in rows:
        t.add_row(*cells(r))
    console.print(t)
    for c in checks:
        mark = "n/a" if c["met"] is None else "met" if c["met"] else "[red]missed[/red]"
        console.print(f"  {c['model']}, {c['threads']} thr: {c['goal']}: {c['value']} -> {mark}")


def markdown(result: dict) -> str:
    rows, checks, m = result["rows"], result["goals"], result["machine"]
    lines = ["# Decode step benchmark (issue 17)", "",
             f"`benchmarks/step_bench.py` on {m['cpu']} ({m['cores']} cores), torch {m['torch']}, "
             f"transformers {m['transformers']}, llama.cpp {m.get('llama_cpp') or '-'}, vLLM {m.get('vllm') or '-'}, "
             f"{m['date']}{', tree ' + m['tree'] if m.get('tree') else ''}; {result['tokens']} tokens per run, prompt of {len(result['prompt_ids'])} tokens; "
             f"the run took {result['wall_s'] / 60:.1f} min.", "",
             "Models (make-tiny qwen3_moe, random weights, bf16, head_dim 128): "
             + "; ".join(f"{k}: " + ", ".join(f"{n} {v}" for n, v in MODELS[k][1].items() if n != "max_shard_size")
                         for k in result["models"]) + ".", "",
             "Arms: experts eager / grouped / grouped + compiled decode step, resident or with half the routed-expert "
             "bytes offloaded (uva; on a CPU the host tier is ordinary memory: this is the offload path's overhead, "
             "not a link). compile_s: one process with an empty inductor cache (cold), then a second over the "
             "cache it left (warm). tok/s: 1 / median inter-token latency of 3 runs (moe-offload), "
             "llama-completion's eval time (llama.cpp, median of 3), (N-1) / (t(N) - t(1)) (vLLM, enforce_eager, "
             "in-process engine, medians of 3). CPU ms/token: (CPU s of an N-token run - of a 1-token run) / (N-1), "
             "medians of 3: the cost of a step with the waits for a shared core left out (at 2 threads it includes "
             "OpenMP spinning). Ratios to llama.cpp are at the same model and threads, higher is better.", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * 3 + "---:|" * 6]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in cells(r)) + " |" for r in rows]
    lines += ["", "## Goals", ""]
    for c in checks:
        mark = "n/a" if c["met"] is None else "**met**" if c["met"] else "**missed**"
        thr = f", {c['threads']} thread{'s' if c['threads'] != 1 else ''}" if c["threads"] else ""
        lines.append(f"- {c['model']}{thr}: {c['goal']}: {c['value']} -> {mark}")
    others = [r["loadavg_before"] - r["threads"] for r in rows if "loadavg_before" in r]
    others = statistics.mean(others) if others else 0.0
    shaky = [f"{r['model'].split()[0]} {r['threads']} thr {r['arm']} ({min(r['tok_s_runs']):.0f}-{max(r['tok_s_runs']):.0f})"
             for r in rows if len(r.get("tok_s_runs") or []) > 1 and max(r["tok_s_runs"]) - min(r["tok_s_runs"]) > 0.25 * r["tok_s"]]
    lines += ["", "## Machine load", "",
              f"1-minute load average {m['loadavg_min']:.2f} to {m['loadavg_max']:.2f} over the run, others' share "
              f"(load average before each moe-offload arm less its threads) {others:.2f} on average, {m['cores']} cores."
              + (" **The machine was shared and busy** (others' tests): a thread of the bench often waited for a "
                 "core, most of all at 2 threads (OpenMP regions wait at each barrier for a descheduled thread); "
                 "CPU ms/token leaves the descheduled time out (not the spinning)." if others > 0.5 else ""),
              "", "Unsteady rows (tok/s of the runs spread by more than 25% of the figure; per-run range): "
              + (", ".join(shaky) if shaky else "none") + "."]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, models, threads = result["rows"], result["models"], result["threads"]
    arms = [a for a in [*ARMS, "llama.cpp", "vLLM"] if any(r["arm"] == a for r in rows)]   # the arms measured
    colours = {"eager": "tab:orange", "grouped": "tab:green", "compiled": "tab:blue", "fused": "tab:red",
               "llama.cpp": "black", "vLLM": "tab:purple"}
    fig, axes = plt.subplots(1, len(threads), figsize=(6.5 * len(threads), 4.2), squeeze=False)
    width = 0.8 / len(arms)
    for ax, t in zip(axes[0], threads):
        for j, arm in enumerate(arms):
            vals = [next((r.get("tok_s") or 0 for r in rows if (r["model"], r["threads"], r["arm"]) == (mdl, t, arm)),
                         0) for mdl in models]
            bars = ax.bar([i + (j - len(arms) / 2 + 0.5) * width for i in range(len(models))], vals, width,
                          color=colours[arm.split()[0]], hatch="//" if "half-off" in arm else None,
                          edgecolor="white" if "half-off" in arm else None, label=arm)
            ax.bar_label(bars, fmt="%.0f", fontsize=6)
        ax.set_xticks(range(len(models)), models, fontsize=8)
        ax.set_ylabel("decode tokens / s")
        ax.set_title(f"{t} thread{'s' if t != 1 else ''}")
        ax.grid(axis="y", alpha=0.3)
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", ncol=len(arms), fontsize=8)
    fig.suptitle(f"decode tok/s, batch 1, bf16, {result['machine']['cpu']} ({result['machine']['cores']} cores); "
                 "hatched: half the expert bytes offloaded", fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))   # the legend below the panels
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def measure(args) -> dict:
    """Every row of one run, with the goals judged and the machine described."""
    begin = time.monotonic()
    tokens = args.tokens or (32 if args.quick else 64)
    models = ["A qwen3-30b-shaped"] if args.quick else [m for m in MODELS if args.full or MODELS[m][2] != "large-matrix"]
    threads = [1] if args.quick else [1, 2]
    where = peers.engines()
    rows, loads, prompt_ids = [], [peers.loadavg()], None
    for label in models:
        folder, sizes, _ = MODELS[label]
        path = ensure_model(args.work / folder, sizes)
        from moe_offload.loading.loader import load_tokenizer

        prompt_ids = load_tokenizer(path)([PROMPT])["input_ids"][0]
        print(f"{label}: llama.cpp ...", file=sys.stderr)
        rows += peers.llama_rows(where, path, label, PROMPT, prompt_ids, tokens, threads)
        for t in threads:
            for arm in ARMS:
                print(f"{label}: {t} thread(s), {arm} ...", file=sys.stderr)
                row = dict(run_child(path, arm, t, tokens), model=label)
                loads += [row.get("loadavg_before", loads[-1]), row.get("loadavg_after", loads[-1])]
                rows.append(row)
                print(f"  {row.get('tok_s', 0):.1f} tok/s" + (f" {row['error'][-300:]}" if "error" in row else ""),
                      file=sys.stderr)
        if not args.no_vllm:
            print(f"{label}: vLLM ...", file=sys.stderr)
            rows += peers.vllm_rows(where, path, label, prompt_ids, tokens, threads)
    order = {a: i for i, a in enumerate([*ARMS, "llama.cpp", "vLLM"])}
    rows.sort(key=lambda r: (models.index(r["model"]), r["threads"], order[r["arm"]]))
    return {"models": models, "shapes": {m: {**COMMON, **MODELS[m][1]} for m in models}, "threads": threads,
            "tokens": tokens, "prompt": PROMPT, "prompt_ids": prompt_ids, "quick": args.quick,
            "wall_s": time.monotonic() - begin,
            "machine": {**peers.machine(where), "loadavg_min": min(loads), "loadavg_max": max(loads)}, "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="model A, 1 thread, 32 tokens: a smoke check")
    ap.add_argument("--full", action="store_true", help="add model C (6.5 GiB)")
    ap.add_argument("--tokens", type=int, help="tokens per run (default 64; 32 with --quick)")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--work", type=Path, default=ROOT / "models" / "step-bench", help="where the models are kept")
    ap.add_argument("--out", type=Path, default=ROOT / "bench-out")
    ap.add_argument("--docs", help="folder for the docs copies (default docs/, none with --quick; \"\": none)")
    ap.add_argument("--from-json", type=Path, help="measure nothing: write the report of a saved step_bench.json")
    ap.add_argument("--child", choices=ARMS)
    ap.add_argument("--child-model", type=Path)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child_model, args.child, args.threads, args.tokens)))
        return 0
    result = json.loads(args.from_json.read_text()) if args.from_json else measure(args)
    quick = result["quick"]
    docs = Path(args.docs) if args.docs else None if args.docs == "" or quick else ROOT / "docs"
    add_ratios(result["rows"])
    result["goals"] = goals(result["rows"], result["tokens"], result["models"])
    print_table(result["rows"], result["goals"])
    write_reports("step_bench", "step-bench.png", result, markdown(result), plot, Path(args.out), docs)
    return 0


def write_reports(name: str, png: str, result: dict, text: str, plot, out: Path, docs: Path | None) -> None:
    """NAME.json, NAME.md and the plot into `out` (bench-out/) and `docs` (None: not there), and say where."""
    for d in [out] + ([docs] if docs else []):
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{name}.json").write_text(json.dumps(result, indent=1, default=str))
        (d / f"{name}.md").write_text(text)
        plot(result, d / png)
    print(f"wrote {out}" + (f" and {docs}" if docs else "") + f" ({result['wall_s']:.0f} s measuring)",
          file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
