"""Routing benchmark: does a placement learned from one kind of text pay off on another?

On the model `make model` trains (benchmarks/train_tiny.py: a Qwen3-MoE trained on the
Python standard library), this measures the link bytes per decoded token of four placements
at the same budgets:

  declaration   module declaration order (today's engines)
  sparse-first  access density, uniform routing assumed: experts before dense tensors
  frequency     expert by expert, least picked first, from statistics of *training-domain* text
  oracle        frequency with statistics from the very trace it is measured on (a floor)

`moe-offload profile` runs the model on three prompt sets of MODEL/eval_texts.json, 200
prompts each, 32 greedy decode tokens after each: pieces of the training text (stdlib code;
the statistics), held-out English prose paragraphs (/usr/share/doc) and pieces of held-out
stdlib files (code the model never saw). Each trace is used two ways:

  generated  the decode tokens the model generated after each prompt (what replay counts);
  text       the prompt text itself: the prompt tokens' routing (prefill rows) relabelled as
             decode rows. A causal model routes a token the same whether it is decoded or
             prefilled, so this is the routing the text would cause if it were decoded. It
             matters because a small model's greedy continuations drift towards its own
             favourite tokens, whatever the prompt was.

Statistics and evaluation are always taken the same way (generated with generated, text with
text), so the kind of text is the only difference between them.

Budget: the input embedding table plus X% of the routed-expert bytes, X = 10..90, the same
byte count for every policy. (Every density-ranked policy offloads the embedding table first:
a token reads one row of it. Without it in the budget, the 10% budget would hold the table
alone and every policy but declaration would read the same.) So at X% sparse-first has X% of
the experts on the host; declaration spends the same bytes in declaration order.

Gap closure at a budget = (sparse-first - frequency) / (sparse-first - oracle): the share of
what the best static placement for the evaluation text saves that statistics from other text
recover. Writes bench-out/routing_bench.{json,png} and docs/routing-bench.png. Traces are
cached in bench-out/routing/ (re-made when the model or these settings change).

Usage: .venv/bin/python benchmarks/routing_bench.py [--model DIR] [--fresh] [--prompts N]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

import moe_offload as mo
from moe_offload.planning import planner
from moe_offload.cli.main import main as cli
from moe_offload.model.inventory import inventory
from moe_offload.planning.placement import GiB
from moe_offload.measure.profile import profile
from moe_offload.routing.replay import replay
from moe_offload.formats.traces import Phase, Trace, expert_counts, read_trace, skew_summary, write_trace

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "trained-qwen3moe"
OUT = ROOT / "bench-out"
TRACES = OUT / "routing"
DOC_PLOT = ROOT / "docs" / "routing-bench.png"
FRACTIONS = tuple(x / 10 for x in range(1, 10))
POLICIES = ("declaration", "sparse-first", "frequency", "oracle")
NEW_TOKENS = 32
# Prompt sets of MODEL/eval_texts.json: the statistics, then the evaluations.
STATS = "train_domain_code"
EVALS = {"heldout_prose": "held-out English prose", "heldout_code": "held-out stdlib code"}
WAYS = {"generated": "decode tokens generated after each prompt", "text": "the held-out text itself"}

console = Console(highlight=False)


def traces(model: Path, fresh: bool, n_prompts: int | None) -> dict[str, Trace]:
    """Profile the prompt sets (cached by model and settings); returns name -> trace."""
    info = json.loads((model / "train_info.json").read_text())
    texts = json.loads((model / "eval_texts.json").read_text())
    texts = {name: texts[name][:n_prompts] for name in (STATS, *EVALS)}
    key = {"model_hash": info["settings_hash"], "new_tokens": NEW_TOKENS, "prompts": {k: len(v) for k, v in texts.items()}}
    meta = TRACES / "meta.json"
    if fresh or not meta.is_file() or json.loads(meta.read_text()) != key:
        shutil.rmtree(TRACES, ignore_errors=True)
        TRACES.mkdir(parents=True)
        for name in (STATS, *EVALS):
            console.print(f"profiling {len(texts[name])} {name} prompts ({NEW_TOKENS} decode tokens each)")
            # EOS ignored: every prompt gives exactly NEW_TOKENS decode rows, so no set is thinner by chance.
            profile(model, TRACES / f"{name}.jsonl", prompts=texts[name], max_new_tokens=NEW_TOKENS,
                    ignore_eos=True, device="cpu")
        for name in (STATS, *EVALS):
            t = read_trace(TRACES / f"{name}.jsonl")
            rows = [replace(r, phase=Phase.DECODE.value) for r in t.rows if r.phase == Phase.PREFILL]
            source = t.header.source + "; prefill rows relabelled decode (routing of the prompt text itself)"
            write_trace(TRACES / f"{name}.text.jsonl", replace(t.header, source=source), rows)
        meta.write_text(json.dumps(key))
    out = {}
    for name in (STATS, *EVALS):
        out[f"{name}/generated"] = read_trace(TRACES / f"{name}.jsonl")
        out[f"{name}/text"] = read_trace(TRACES / f"{name}.text.jsonl")
    return out


def budgets(model: Path) -> tuple[dict[float, int], int, int]:
    """fraction -> budget bytes (embedding table + fraction of routed-expert bytes)."""
    base = mo.plan(model, offload_gb=0)
    routed = sum(t.bytes for t in base.tensors if t.role == "routed_expert")
    embedding = sum(t.bytes for t in base.tensors if t.role == "embedding")
    return {f: embedding + round(f * routed) for f in FRACTIONS}, routed, embedding


def measure(model: Path, tr: dict[str, Trace]) -> list[dict]:
    budget, _, _ = budgets(model)
    inv = inventory(model)   # read once: every plan below is a pure function of it
    # Statistics and evaluation are made the same way (both generated, or both the text itself),
    # so that the kind of text is the only thing that differs between them.
    stats = {way: expert_counts(tr[f"{STATS}/{way}"]) for way in WAYS}
    rows = []
    for fraction, nbytes in budget.items():
        gb = nbytes / GiB
        fixed = {p: planner.plan(inv, offload_gb=gb, policy=p) for p in ("declaration", "sparse-first")}
        for way in WAYS:
            fixed[way] = planner.plan(inv, offload_gb=gb, policy="frequency", stats=stats[way])
        for name in EVALS:
            for way in WAYS:
                trace = tr[f"{name}/{way}"]
                plans = {"declaration": fixed["declaration"], "sparse-first": fixed["sparse-first"],
                         "frequency": fixed[way],
                         "oracle": planner.plan(inv, offload_gb=gb, policy="frequency", stats=expert_counts(trace))}
                res = {p: replay(plans[p], trace, policy=p) for p in POLICIES}
                by = {p: r.link_bytes_per_token for p, r in res.items()}
                gap = by["sparse-first"] - by["oracle"]
                # Below 1% of sparse-first's bytes the gap is noise in the last experts moved: no ratio.
                closure = (by["sparse-first"] - by["frequency"]) / gap if gap > 0.01 * by["sparse-first"] else None
                rows.append({
                    "eval": name, "way": way, "fraction": fraction, "budget_bytes": nbytes, "tokens": res["oracle"].tokens,
                    "link_bytes_per_token": by, "offloaded_bytes": {p: r.offloaded_bytes for p, r in res.items()},
                    "expert_reads": {p: r.expert_reads for p, r in res.items()}, "gap_closure": closure,
                })
    return rows


def cross_check(model: Path, rows: list[dict]) -> None:
    """The same numbers through the command line (`moe-offload replay --json`), at the 50% budget."""
    stats = TRACES / f"{STATS}.jsonl"
    for name in EVALS:
        row = next(r for r in rows if r["eval"] == name and r["way"] == "generated" and r["fraction"] == 0.5)
        for policy in ("sparse-first", "frequency", "oracle"):
            argv = ["replay", str(model), "--trace", str(TRACES / f"{name}.jsonl"), "--json", "--policy", policy,
                    "--offload-gb", repr(row["budget_bytes"] / GiB)] + (["--stats", str(stats)] if policy == "frequency" else [])
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                rc = cli(argv)
            got = json.loads(buf.getvalue())["link_bytes_per_token"] if rc == 0 else None
            want = row["link_bytes_per_token"][policy]
            if got != want:
                raise SystemExit(f"moe-offload replay {' '.join(argv[1:])} gave {got}, the API gave {want}: "
                                 "the command line and the Python API disagree")
    console.print("cross-check: `moe-offload replay --json` gives the same bytes per token as the API "
                  f"(50% budget, {len(EVALS)} evaluations x 3 policies)")


def tables(rows: list[dict]) -> None:
    for name, label in EVALS.items():
        for way, how in WAYS.items():
            sel = [r for r in rows if r["eval"] == name and r["way"] == way]
            t = Table(title=f"{label}, {how} ({sel[0]['tokens']} tokens): link KiB per decoded token",
                      title_justify="left")
            t.add_column("experts offloaded", justify="right")
            for p in POLICIES:
                t.add_column(p, justify="right")
            t.add_column("gap closed", justify="right")
            for r in sel:
                by = r["link_bytes_per_token"]
                c = r["gap_closure"]
                t.add_row(f"{r['fraction']:.0%}", *(f"{by[p] / 1024:.1f}" for p in POLICIES),
                          "n/a" if c is None else f"{c:.0%}")
            console.print(t)


def skews(tr: dict[str, Trace]) -> dict[str, list[dict]]:
    out = {}
    t = Table(title="routing skew: share of expert picks served by the busiest 10% of each layer's experts "
                    "(uniform 12.5%)", title_justify="left")
    t.add_column("trace")
    layers = tr[f"{STATS}/text"].header.layers
    for layer in layers:
        t.add_column(f"layer {layer}", justify="right")
    for name, trace in tr.items():
        out[name] = skew_summary(trace)
        t.add_row(name, *(f"{s['top10_share']:.1%}" for s in out[name]))
    console.print(t)
    return out


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(WAYS), len(EVALS), figsize=(12, 8.5), sharex=True, squeeze=False)
    for j, (name, label) in enumerate(EVALS.items()):
        for i, (way, how) in enumerate(WAYS.items()):
            ax = axes[i][j]
            sel = [r for r in rows if r["eval"] == name and r["way"] == way]
            xs = [100 * r["fraction"] for r in sel]
            for p, style in zip(POLICIES, ("s-", "o-", "^-", "v--")):
                ax.plot(xs, [r["link_bytes_per_token"][p] / 1024 for r in sel], style, label=p)
            ax.set_yscale("log")
            ax.set_title(f"{label}: {how}", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            if i == len(WAYS) - 1:
                ax.set_xlabel("budget: embedding table + this % of the routed-expert bytes")
            if j == 0:
                ax.set_ylabel("link KiB per decoded token")
    axes[0][0].legend()
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--fresh", action="store_true", help="profile again even when cached traces match")
    parser.add_argument("--prompts", type=int, help="use only the first N prompts of each set (a quick look)")
    args = parser.parse_args()
    model = args.model.resolve()
    if not (model / "eval_texts.json").is_file():
        console.print(f"error: {model} is not a model trained by benchmarks/train_tiny.py (no eval_texts.json); "
                      "the routing benchmark needs its real routing. Fix: run `make model` first.")
        return 2
    tr = traces(model, args.fresh, args.prompts)
    skew = skews(tr)
    rows = measure(model, tr)
    tables(rows)
    cross_check(model, rows)
    _, routed, embedding = budgets(model)
    info = json.loads((model / "train_info.json").read_text())
    s = info["settings"]
    title = (f"trained qwen3_moe ({s['layers']} layers x {s['experts']} experts, top-{s['top_k']}); "
             "statistics from training-domain code (stdlib), evaluated on held-out text")
    OUT.mkdir(exist_ok=True)
    doc = {"model": str(model), "model_settings_hash": info["settings_hash"], "routed_expert_bytes": routed,
           "embedding_bytes": embedding,
           "budget": "embedding table bytes + fraction x routed-expert bytes, the same for every policy",
           "stats_traces": {way: str(TRACES / f"{STATS}{'' if way == 'generated' else '.text'}.jsonl") for way in WAYS},
           "decode_tokens_per_prompt": NEW_TOKENS,
           "skew": skew, "rows": rows}
    (OUT / "routing_bench.json").write_text(json.dumps(doc, indent=1))
    plot(rows, OUT / "routing_bench.png", title)
    DOC_PLOT.parent.mkdir(exist_ok=True)
    shutil.copyfile(OUT / "routing_bench.png", DOC_PLOT)
    console.print(f"wrote {OUT / 'routing_bench.json'}, {OUT / 'routing_bench.png'} and {DOC_PLOT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
