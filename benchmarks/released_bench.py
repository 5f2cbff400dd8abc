"""The decode step at released model dimensions: moe-offload against llama.cpp (and vLLM CPU) in one run (issue 25).

Random-weight checkpoints with the exact layers of released models, a few of their layers, made by
`moe-offload make-tiny --like` (once, under models/released/, or --work DIR) in the released on-disk formats:

- qwen3-30b-a3b, 8 of 48 layers (hidden 2048, 128 experts of 768, top-8, 32 heads of 128, 4 KV heads),
  bf16 (10.4 GiB) and FP8 (e4m3 + 128x128 block scales, as Qwen3-30B-A3B-FP8);
- gpt-oss-20b, 4 of 24 layers (hidden 2880, 32 experts of 2880, top-4, sinks, sliding window), MXFP4 experts
  (as released) and the same model in bf16 (--quant none);
- deepseek-v2-lite, 6 of 27 layers (hidden 2048, multi-head latent attention, the first layer dense, then 64
  routed experts of 1408, top-6, and 2 shared), bf16 (6.5 GiB).

moe-offload arms (each in a fresh process: step_bench.run_child): the experts computed by the CPU kernels on
the stored format (`fused`, the CLI's default: the dense Linears' decode calls too) and by transformers' eager
loop (`eager`, the Python API's default), resident; with --arms, `fused half-off`: half the routed-expert bytes
in the host tier (uva: on a CPU ordinary memory, so this is the offload path's overhead). tok/s = 1 / median inter-token latency of 3 runs.
llama.cpp: llama-completion's eval time (median of 3) on its own conversion of the same checkpoint: bf16 for
bf16; Q8_0 beside FP8 (llama.cpp has no FP8 type: its nearest 8-bit format, converted from the bf16 model);
gpt-oss's converter keeps the MXFP4 experts as MXFP4. vLLM CPU on every model it loads (--vllm; a model it refuses is a row saying why).
Threads 1 and 2. Ratios: each row over llama.cpp at the same model and threads; FP8 / MXFP4 over the same
model in bf16 (same engine, threads, arm); two threads over one.

    .venv/bin/python benchmarks/released_bench.py [--quick] [--models a,b] [--tokens 32] [--vllm] [--work DIR]

--quick: qwen3 bf16, 2 threads, fused and llama.cpp only, 16 tokens; writes bench-out/ only. Otherwise
bench-out/ and docs/ (released_bench.json, released_bench.md, released-bench.png).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import step_bench as sb  # noqa: E402
import step_bench_peers as peers  # noqa: E402

MODELS = {   # label: (folder, make-tiny arguments, llama.cpp outtype, same model in bf16)
    "qwen3-30b-a3b bf16": ("qwen3-30b-a3b-8L", ["--like", "qwen3-30b-a3b", "--layers", "8"], "bf16", None),
    "qwen3-30b-a3b FP8": ("qwen3-30b-a3b-8L-fp8", ["--like", "qwen3-30b-a3b", "--layers", "8", "--quant", "fp8"],
                          "q8_0", "qwen3-30b-a3b bf16"),
    "gpt-oss-20b bf16": ("gpt-oss-20b-4L-bf16", ["--like", "gpt-oss-20b", "--layers", "4", "--quant", "none"],
                         "bf16", None),
    "gpt-oss-20b MXFP4": ("gpt-oss-20b-4L", ["--like", "gpt-oss-20b", "--layers", "4"], "bf16", "gpt-oss-20b bf16"),
    "deepseek-v2-lite bf16": ("deepseek-v2-lite-6L", ["--like", "deepseek-v2-lite", "--layers", "6"], "bf16", None),
}
ARMS = ["fused", "eager", "fused half-off"]   # the last only with --arms (not in the default run)
PROMPT = sb.PROMPT


def ensure_model(folder: Path, args: list[str]) -> Path:
    """The checkpoint, made once (make-tiny writes its folder whole or not at all); a folder made by other
    arguments is refused rather than reused."""
    stamp = folder / "released_bench.args.json"
    if stamp.is_file():
        if json.loads(stamp.read_text()) != args:
            raise SystemExit(f"{folder} was made with other arguments: remove it or pass --work DIR")
        return folder
    if folder.exists():
        raise SystemExit(f"{folder} exists but was not made by this benchmark: remove it or pass --work DIR")
    print(f"making {folder.name} (once; cached) ...", file=sys.stderr)
    subprocess.run([str(Path(sys.executable).parent / "moe-offload"), "make-tiny", *args, str(folder)], check=True)
    stamp.write_text(json.dumps(args))
    return folder


def add_ratios(rows: list[dict]) -> None:
    """vs llama.cpp (same model, threads), vs bf16 (same engine, arm, threads), 2 threads vs 1 (same arm)."""
    sb.add_ratios(rows)
    key = {(r["model"], r["arm"], r["threads"]): r for r in rows if r.get("tok_s")}
    for r in rows:
        ref = MODELS[r["model"]][3]
        base = key.get((ref, r["arm"], r["threads"])) if ref else None
        r["vs_bf16"] = r["tok_s"] / base["tok_s"] if base and r.get("tok_s") else None
        one = key.get((r["model"], r["arm"], 1))
        r["two_vs_one"] = r["tok_s"] / one["tok_s"] if r["threads"] == 2 and one and r.get("tok_s") else None


def goals(rows: list[dict]) -> list[dict]:
    """The issue's goals, each met or missed, on the fused arm (the default)."""
    fused = {(r["model"], r["threads"]): r for r in rows if r["arm"] == "fused" and r.get("tok_s")}
    out = []

    def judge(text, value, target):
        out.append({"goal": text, "value": value, "met": value is not None and value >= target})

    for (model, t), r in sorted(fused.items()):
        if model in ("qwen3-30b-a3b bf16", "gpt-oss-20b MXFP4"):
            target = 0.9 if model.startswith("qwen3") else 1.0
            judge(f"{model}, {t} thread(s): decode >= {target}x llama.cpp", r.get("vs_llama_cpp"), target)
        if model == "qwen3-30b-a3b FP8":
            judge(f"{model}, {t} thread(s): >= 1.6x the bf16 model", r.get("vs_bf16"), 1.6)
        if model == "gpt-oss-20b MXFP4":
            judge(f"{model}, {t} thread(s): >= 2.5x the bf16 model", r.get("vs_bf16"), 2.5)
        if t == 2:
            judge(f"{model}: two threads >= 1.6x one", r.get("two_vs_one"), 1.6)
    return out


def _f(v, fmt="{:.2f}x"):
    return fmt.format(v) if v is not None else "-"


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [
        "# Decode at released model dimensions (issue 25)", "",
        f"`benchmarks/released_bench.py` on {m['cpu']} ({m['cores']} cores), torch {m['torch']}, transformers "
        f"{m['transformers']}, llama.cpp {m['llama_cpp']}, vLLM {m['vllm']}, {m['date']}; {result['tokens']} tokens "
        f"per run; load average {m['loadavg_min']:.2f}-{m['loadavg_max']:.2f}; the run took "
        f"{result['wall_s'] / 60:.1f} min.", "",
        "Models: `make-tiny --like` (random weights, the released layer dimensions and on-disk format): "
        + "; ".join(f"{k}: `{' '.join(MODELS[k][1])}`" for k in result["models"]) + ".", "",
        " ".join(next(p for p in __doc__.split("\n\n") if p.startswith("moe-offload arms")).split()), "",
        *[f"- {n}" for n in result.get("notes", [])], *([""] if result.get("notes") else []),
        "| model | threads | arm | tok/s | x llama.cpp | x bf16 model | 2 threads / 1 | ITL p50 ms | TTFT ms | "
        "llama.cpp GGUF |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['threads']} | {r['arm']} | error: {r['error'][-160:]!r} |"
                         " | | | | | |")
            continue
        lines.append(f"| {r['model']} | {r['threads']} | {r['arm']} | {r['tok_s']:.2f} | {_f(r.get('vs_llama_cpp'))} | "
                     f"{_f(r.get('vs_bf16'))} | {_f(r.get('two_vs_one'))} | {_f(r.get('itl_p50_ms'), '{:.1f}')} | "
                     f"{_f(r.get('ttft_ms'), '{:.0f}')} | {r.get('gguf_type', '')} |")
    lines += ["", "## Goals (the fused arm, the default)", ""]
    lines += [f"- {g['goal']}: {_f(g['value'])} -> **{'met' if g['met'] else 'missed'}**" for g in result["goals"]]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r.get("tok_s")]
    arms = [a for a in [*ARMS, "llama.cpp", "vLLM"] if any(r["arm"] == a for r in rows)]
    groups = [(m, t) for m in result["models"] for t in result["threads"]]
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(groups)), 4.5))
    width = 0.8 / max(1, len(arms))
    for i, arm in enumerate(arms):
        vals = [next((r["tok_s"] for r in rows if (r["model"], r["threads"], r["arm"]) == (m, t, arm)), 0)
                for m, t in groups]
        ax.bar([g + i * width for g in range(len(groups))], vals, width, label=arm)
    ax.set_xticks([g + width * (len(arms) - 1) / 2 for g in range(len(groups))])
    ax.set_xticklabels([f"{m}\n{t} thr" for m, t in groups], fontsize=7)
    ax.set_ylabel("decode tok/s")
    ax.set_title(f"Decode at released dimensions, {result['machine']['cpu']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def measure(args) -> dict:
    begin = time.monotonic()
    models = args.models or (["qwen3-30b-a3b bf16"] if args.quick else list(MODELS))
    threads = [2] if args.quick else [1, 2]
    arms = ["fused"] if args.quick else args.arms
    where = peers.engines()
    rows, loads = [], [peers.loadavg()]
    prompt_ids = None
    for label in models:
        folder, make_args, outtype, _ = MODELS[label]
        path = ensure_model(args.work / folder, make_args)
        from moe_offload.loading.loader import load_tokenizer

        prompt_ids = load_tokenizer(path)([PROMPT])["input_ids"][0]
        print(f"{label}: llama.cpp ({outtype}) ...", file=sys.stderr)
        ref = MODELS[label][3]   # Q8_0 is converted from the bf16 model (the converter reads no FP8 scales)
        src = ensure_model(args.work / MODELS[ref][0], MODELS[ref][1]) if outtype == "q8_0" and ref else path
        got = peers.llama_rows(where, src, label, PROMPT, prompt_ids, args.tokens, threads, outtype=outtype)
        rows += got
        for r in got:
            print(f"  {r['threads']} thr: {r.get('tok_s', 0):.2f} tok/s {r.get('error', '')[-300:]}", file=sys.stderr)
        for t in threads:
            for arm in arms:
                print(f"{label}: {t} thread(s), {arm} ...", file=sys.stderr)
                row = dict(sb.run_child(path, arm, t, args.tokens), model=label)
                loads += [row.get("loadavg_before", loads[-1]), row.get("loadavg_after", loads[-1])]
                rows.append(row)
                print(f"  {row.get('tok_s', 0):.2f} tok/s" + (f" {row['error'][-300:]}" if "error" in row else ""),
                      file=sys.stderr)
        if args.vllm:
            print(f"{label}: vLLM ...", file=sys.stderr)
            rows += peers.vllm_rows(where, path, label, prompt_ids, args.tokens, threads)
    order = {a: i for i, a in enumerate([*ARMS, "llama.cpp", "vLLM"])}
    rows.sort(key=lambda r: (models.index(r["model"]), r["threads"], order[r["arm"]]))
    return {"models": models, "threads": threads, "tokens": args.tokens, "prompt": PROMPT, "prompt_ids": prompt_ids,
            "quick": args.quick, "wall_s": time.monotonic() - begin,
            "machine": {**peers.machine(where), "loadavg_min": min(loads), "loadavg_max": max(loads)}, "rows": rows}


def merge(old: dict, new: dict) -> dict:
    """`old` with the rows of `new`'s models replaced by `new`'s: each model's rows still come from one run (its
    ratios are within that run); a note says which models were measured when."""
    kept = [r for r in old["rows"] if r["model"] not in new["models"]]
    models = [m for m in MODELS if m in old["models"] or m in new["models"]]
    order = {a: i for i, a in enumerate([*ARMS, "llama.cpp", "vLLM"])}
    rows = sorted(kept + new["rows"], key=lambda r: (models.index(r["model"]), r["threads"], order[r["arm"]]))
    note = (f"Rows of {', '.join(new['models'])} from a run at tree {new['machine'].get('tree')}, "
            f"{new['machine']['date']} ({new['wall_s'] / 60:.1f} min); the others from the run in the header.")
    return {**old, "rows": rows, "models": models, "notes": [*old.get("notes", []), note]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="qwen3 bf16, 2 threads, fused and llama.cpp, 16 tokens")
    ap.add_argument("--models", type=lambda s: [m.strip() for m in s.split(",")],
                    help=f"comma-separated, of: {', '.join(MODELS)}")
    ap.add_argument("--tokens", type=int, help="new tokens per run (default 32; 16 with --quick)")
    ap.add_argument("--arms", type=lambda s: [a.strip() for a in s.split(",")], default=["fused", "eager"],
                    help=f"moe-offload arms, comma-separated, of: {', '.join(ARMS)} (default fused,eager)")
    ap.add_argument("--vllm", action="store_true", help="add vLLM CPU (slow to load)")
    ap.add_argument("--work", type=Path, default=ROOT / "models" / "released", help="where the models are kept")
    ap.add_argument("--out", type=Path, default=ROOT / "bench-out")
    ap.add_argument("--merge-into", type=Path, help="a saved json whose rows of the models measured now are "
                    "replaced by this run's (the other models' rows, and their run, are kept and said so)")
    ap.add_argument("--from-json", type=Path, help="measure nothing: write the report of a saved json (its "
                    "\"notes\" list, if any, is printed under the method)")
    args = ap.parse_args(argv)
    if args.models and not set(args.models) <= set(MODELS):
        ap.error(f"unknown model(s) {sorted(set(args.models) - set(MODELS))}; known: {', '.join(MODELS)}")
    if not set(args.arms) <= set(ARMS):
        ap.error(f"unknown arm(s) {sorted(set(args.arms) - set(ARMS))}; known: {', '.join(ARMS)}")
    args.tokens = args.tokens or (16 if args.quick else 32)
    result = json.loads(args.from_json.read_text()) if args.from_json else measure(args)
    if args.merge_into:
        result = merge(json.loads(args.merge_into.read_text()), result)
    add_ratios(result["rows"])
    result["goals"] = goals(result["rows"])
    text = markdown(result)
    print(text)
    sb.write_reports("released_bench", "released-bench.png", result, text, plot, args.out,
                     None if result["quick"] else ROOT / "docs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
