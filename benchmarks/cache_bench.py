"""What a device-side expert cache saves: link bytes per decoded token for no cache, lru, lfu, heat, belady.

Every number is counted by `replay` (moe_offload.routing.replay): the decode tokens of a routing trace
are replayed through a placement and a cache (moe_offload.routing.cache_policy, the same objects the
runtime drives), and the bytes that would cross the host link are summed from the model's
tensor sizes. Nothing is timed and nothing is estimated from model size: bytes per token is
(offloaded dense bytes + the bytes of every picked offloaded expert the cache missed) / tokens.

The trace (in order of preference):
  --trace FILE [--model DIR|config.json] [--stats FILE]   any trace of a model you have;
  the trained model (`make model`, models/trained-qwen3moe): the routing of its held-out
    English prose and held-out stdlib code (the text itself, as benchmarks/routing_bench.py
    profiles and caches it in bench-out/routing/), frequency statistics from training-domain
    code (text the replayed tokens never saw);
  neither: a clearly labelled synthetic skewed trace (Zipf-like popularity per layer, tokens
    that tend to repeat the previous token's experts), on a small qwen3_moe config.

Placements (each at the same trace): sparse-first with every routed expert offloaded;
sparse-first with half of the routed-expert bytes offloaded; frequency (statistics from
--stats, or the training-domain trace) with the same half. Cache sizes: 5% to 75% of the
offloaded experts, in whole experts. Belady is the offline optimum (it knows the trace),
the floor every online policy is measured against. Goal (issue 9): heat reads at most 1.3x
Belady's bytes wherever LRU reads more than 1.5x; the table says where it does not.

Usage: .venv/bin/python benchmarks/cache_bench.py [--trace FILE] [--model M] [--stats FILE] [--out bench-out]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

import moe_offload as mo
from moe_offload.routing.cache_policy import DEFAULT_CACHE_POLICY
from moe_offload.planning.placement import GiB, format_bytes
from moe_offload.routing.replay import replay
from moe_offload.formats.traces import Trace, TraceHeader, TraceRow, read_trace, write_trace

ROOT = Path(__file__).resolve().parent.parent
TRAINED = ROOT / "models" / "trained-qwen3moe"
POLICIES = ("lru", "lfu", DEFAULT_CACHE_POLICY, "belady")
REFERENCES = ("pinned*", "per-request*")  # clairvoyant references (hindsight_misses)
FRACTIONS = (0.05, 0.10, 0.20, 0.30, 0.50, 0.75)
HALF = 0.5
console = Console(highlight=False, width=max(Console().width, 150))  # the tables are wide


@dataclass(frozen=True)
class Case:
    label: str          # what the trace is
    model: Path         # model folder or config.json: tensor sizes for the plans
    trace: Trace        # decode tokens replayed
    stats: Trace | None  # statistics for the frequency placement (None: the trace's own, labelled so)


# -- where the routing comes from ----------------------------------------------------------------------

def trained_cases(model: Path) -> list[Case]:
    """The routing benchmark's traces of the trained model (benchmarks/routing_bench.py profiles them once and
    caches them in bench-out/routing/): the routing of its held-out prose and code, the text itself;
    statistics from the training-domain text."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from routing_bench import EVALS, STATS, traces

    found = traces(model, fresh=False, n_prompts=None)
    stats = found.get(f"{STATS}/text") or found[f"{STATS}/generated"]
    return [Case(f"{model.name}: {label}", model, found[f"{name}/text"], stats) for name, label in EVALS.items()]


SYNTH_CONFIG = {
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 256,
    "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "num_experts": 32, "num_experts_per_tok": 4, "vocab_size": 1024,
    "tie_word_embeddings": False, "dtype": "bfloat16",
}


def synthetic_trace(seed: int, sequences: int = 48, tokens: int = 64) -> Trace:
    """SYNTHETIC routing: per layer a fixed skewed popularity, per sequence a topic shift, and a pull towards
    the previous token's experts (routers of trained models repeat themselves); top-k by Gumbel noise."""
    c = SYNTH_CONFIG
    n_layers, n_exp, k = c["num_hidden_layers"], c["num_experts"], c["num_experts_per_tok"]
    rng = np.random.default_rng(seed)
    base = rng.normal(size=(n_layers, n_exp)) * 1.2
    rows = []
    for s in range(sequences):
        topic = rng.normal(size=(n_layers, n_exp)) * 0.6
        prev = np.zeros((n_layers, n_exp))
        for t in range(tokens):
            logits = base + topic + 1.0 * prev + rng.gumbel(size=(n_layers, n_exp))
            picks = np.argsort(-logits, axis=1)[:, :k]
            prev = np.zeros((n_layers, n_exp))
            np.put_along_axis(prev, picks, 1.0, axis=1)
            rows.append(TraceRow(s, t, "decode", tuple(tuple(int(e) for e in p) for p in picks)))
    header = TraceHeader("qwen3_moe", n_exp, k, tuple(range(n_layers)), f"SYNTHETIC (cache_bench.py, seed {seed})")
    return Trace(header, tuple(rows), f"synthetic-{seed}")


def synthetic_cases(tmp: Path) -> list[Case]:
    (tmp / "config.json").write_text(json.dumps(SYNTH_CONFIG))
    return [Case("SYNTHETIC skewed routing (no trained model: `make model`)", tmp / "config.json",
                 synthetic_trace(1), synthetic_trace(2))]


# -- the measurement -----------------------------------------------------------------------------------

def _sizes(model: Path) -> tuple[int, int]:
    """(bytes of all routed experts, bytes of the embedding table) of the model."""
    roles = mo.plan(model, offload_gb=0).roles()
    return roles["routed_expert"]["bytes"], roles["embedding"]["bytes"]


def placements(case: Case) -> list[tuple[str, "mo.Plan"]]:
    """Each budget is the embedding table (density 1/vocab: both policies offload it first) plus a share of the
    routed-expert bytes, so that what is offloaded beyond one embedding row per token is experts alone."""
    from moe_offload.formats.traces import expert_counts

    experts, embedding = _sizes(case.model)
    gb = lambda share: (embedding + share * experts) / GiB  # noqa: E731
    stats = expert_counts(case.stats or case.trace)
    return [("sparse-first, all experts offloaded", mo.plan(case.model, offload_gb=gb(1.0))),
            (f"sparse-first, {HALF:.0%} of expert bytes offloaded", mo.plan(case.model, offload_gb=gb(HALF))),
            (f"frequency, {HALF:.0%} of expert bytes offloaded" + ("" if case.stats else " (stats: the trace itself)"),
             mo.plan(case.model, offload_gb=gb(HALF), policy="frequency", stats=stats))]


def hindsight_misses(plan, trace: Trace, slots: list[int]) -> dict[int, tuple[int, int]]:
    """Two caches that know the trace, per cache size in experts: (pinned, per-request) misses.

    pinned: holds the n experts the whole trace picks most, each loaded at its first use, and nothing else
    (the best static content in hindsight); per-request: the same chosen afresh for each sequence, an expert
    new to a sequence's set loaded at its first use there: what a cache would read if it knew how often
    each request will use each expert (a floor for caches that track frequencies, however fast they adapt).
    Both are real (clairvoyant) caches, so belady reads no more than either."""
    from moe_offload.routing.replay import access_keys
    from moe_offload.formats.traces import routing_array

    tb = plan.token_bytes()
    rows = trace.decode_rows
    width = max(1, max(len(ids) for r in rows for ids in r.experts))
    per_seq = [Counter(access_keys(tb, routing_array([r for r in rows if r.seq == seq], width, len(tb.layers))))
               for seq in dict.fromkeys(r.seq for r in rows)]
    whole = sum(per_seq, Counter())
    total = sum(whole.values())
    out = {}
    for n in slots:
        top = whole.most_common(n)
        pinned = total - sum(c for _, c in top) + len(top)
        per_request, held = 0, set()
        for counts in per_seq:
            top = counts.most_common(n)
            chosen = {k for k, _ in top}
            per_request += sum(counts.values()) - sum(c for _, c in top) + len(chosen - held)
            held = chosen
        out[n] = (pinned, per_request)
    return out


def measure(case: Case) -> list[dict]:
    rows = []
    for name, plan in placements(case):
        tb = plan.token_bytes()
        per_expert = (tb.expert_host + tb.expert_disk)[(tb.expert_host + tb.expert_disk) > 0]
        offloaded_experts, expert = int(per_expert.size), int(per_expert.max())
        assert per_expert.min() == expert, "the cache sizes below assume equal expert bytes"
        base = replay(plan, case.trace)
        common = dict(trace=case.label, placement=name, tokens=base.tokens, offloaded_experts=offloaded_experts,
                      expert_bytes=expert)
        rows.append(dict(common, fraction=0.0, cache_experts=0, cache_bytes=0, policy="none",
                         link_bytes_per_token=base.link_bytes_per_token, expert_reads=base.expert_reads,
                         cache_hits=0, seconds=0.0))
        sizes = {frac: max(1, round(frac * offloaded_experts)) for frac in FRACTIONS}
        refs = hindsight_misses(plan, case.trace, list(sizes.values()))
        for frac, n in sizes.items():
            for policy in POLICIES:
                start = time.perf_counter()
                # half an expert more than n: the GiB float cannot round the capacity below n experts
                r = replay(plan, case.trace, cache_gb=(n * expert + expert // 2) / GiB, cache_policy=policy)
                rows.append(dict(common, fraction=frac, cache_experts=n, cache_bytes=r.cache_bytes, policy=policy,
                                 link_bytes_per_token=r.link_bytes_per_token, expert_reads=r.expert_reads,
                                 cache_hits=r.cache_hits, seconds=time.perf_counter() - start))
            for ref, misses in zip(REFERENCES, refs[n]):
                saved = (base.expert_reads - misses) * expert / base.tokens   # the hits, which read nothing
                rows.append(dict(common, fraction=frac, cache_experts=n, cache_bytes=n * expert, policy=ref,
                                 link_bytes_per_token=base.link_bytes_per_token - saved, expert_reads=misses,
                                 cache_hits=base.expert_reads - misses, seconds=0.0))
    return rows


def verdicts(rows: list[dict]) -> list[dict]:
    """Per cache size: each policy over Belady, and whether the goal holds where it applies."""
    by = {(r["trace"], r["placement"], r["fraction"], r["policy"]): r for r in rows}
    out = []
    for r in rows:
        if r["policy"] != "belady":
            continue
        key = (r["trace"], r["placement"], r["fraction"])
        floor = r["link_bytes_per_token"]
        ratio = {p: by[key + (p,)]["link_bytes_per_token"] / floor if floor else 1.0 for p in (*POLICIES, *REFERENCES)}
        applies = ratio["lru"] > 1.5
        out.append(dict(trace=key[0], placement=key[1], fraction=key[2], cache_experts=r["cache_experts"],
                        ratio=ratio, goal_applies=applies,
                        goal_met=(ratio[DEFAULT_CACHE_POLICY] <= 1.3) if applies else None))
    return out


# -- output --------------------------------------------------------------------------------------------

def print_tables(rows: list[dict], checks: list[dict]) -> None:
    by = {(r["trace"], r["placement"], r["fraction"], r["policy"]): r for r in rows}
    check = {(c["trace"], c["placement"], c["fraction"]): c for c in checks}
    for trace in dict.fromkeys(r["trace"] for r in rows):
        for place in dict.fromkeys(r["placement"] for r in rows if r["trace"] == trace):
            none = by[(trace, place, 0.0, "none")]
            t = Table(title=f"{trace} -- {place}: {none['tokens']} decode tokens, {none['offloaded_experts']} "
                            f"experts offloaded; no cache reads {format_bytes(none['link_bytes_per_token'])}/token",
                      title_justify="left")
            for col in ("cache (experts)", *POLICIES, *REFERENCES, "lru/bel", f"{DEFAULT_CACHE_POLICY}/bel",
                        "per-req/bel", "goal"):
                t.add_column(col, justify="left" if col == "goal" else "right")
            for frac in FRACTIONS:
                c = check[(trace, place, frac)]
                goal = "n/a" if not c["goal_applies"] else "met" if c["goal_met"] else "[red]missed[/red]"
                t.add_row(f"{frac:.0%} ({c['cache_experts']})",
                          *(format_bytes(by[(trace, place, frac, p)]["link_bytes_per_token"])
                            for p in (*POLICIES, *REFERENCES)),
                          f"{c['ratio']['lru']:.2f}x", f"{c['ratio'][DEFAULT_CACHE_POLICY]:.2f}x",
                          f"{c['ratio']['per-request*']:.2f}x", goal)
            console.print(t)
    console.print("per token, replayed; bel = belady, the offline optimum. * clairvoyant references: pinned = the "
                  "trace's most-picked experts, loaded at first use and held; per-request = the same chosen afresh "
                  "for each sequence (a floor for frequency-tracking caches). goal: heat <= 1.3x belady where lru "
                  "> 1.5x belady (n/a: lru <= 1.5x).")


LABELS = {"belady": "belady (offline optimum)", "pinned*": "clairvoyant: most-picked experts pinned",
          "per-request*": "clairvoyant: most-picked of each request"}


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(dict.fromkeys(r["trace"] for r in rows))
    places = list(dict.fromkeys(r["placement"] for r in rows))
    fig, axes = plt.subplots(len(traces), len(places), figsize=(5.2 * len(places), 4.0 * len(traces)),
                             squeeze=False)
    styles = {"lru": ("tab:orange", "o", "-"), "lfu": ("tab:green", "s", "-"),
              DEFAULT_CACHE_POLICY: ("tab:blue", "D", "-"), "belady": ("black", "^", "-"),
              "pinned*": ("tab:purple", "", ":"), "per-request*": ("tab:red", "", ":")}
    for i, trace in enumerate(traces):
        for j, place in enumerate(places):
            ax = axes[i][j]
            sel = [r for r in rows if r["trace"] == trace and r["placement"] == place]
            none = next(r for r in sel if r["policy"] == "none")
            scale, unit = next(((s, u) for s, u in ((GiB, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))
                                if none["link_bytes_per_token"] >= s), (1, "bytes"))
            ax.axhline(none["link_bytes_per_token"] / scale, color="grey", ls="--", label="no cache")
            for p in (*POLICIES, *REFERENCES):
                pts = sorted((r["fraction"], r["link_bytes_per_token"]) for r in sel if r["policy"] == p)
                colour, marker, ls = styles[p]
                ax.plot([100 * f for f, _ in pts], [b / scale for _, b in pts], marker=marker, color=colour, ls=ls,
                        label=LABELS.get(p, p), lw=1.6 if ls == "-" else 1.0, ms=4)
            ax.set_title(f"{trace}\n{place}", fontsize=9)
            ax.set_xlabel("cache size, % of the offloaded experts")
            ax.set_ylabel(f"link {unit} per decoded token (log)")
            ax.set_yscale("log")  # equal gaps are equal ratios: what "x Belady" means
            ax.grid(alpha=0.3)
            if i == 0 and j == 0:
                ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, help="replay this trace (default: the trained model's held-out text)")
    ap.add_argument("--model", type=Path, help="with --trace: the model (folder or config.json) it was made with")
    ap.add_argument("--stats", type=Path, help="with --trace: statistics for the frequency placement "
                                               "(default: the trace itself, labelled so)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench-out", help="where JSON and plot go")
    ap.add_argument("--docs", default=str(ROOT / "docs"), help="folder for a copy of the plot (\"\": none)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        if args.trace:
            if args.model is None:
                ap.error("--trace needs --model (the folder or config.json whose tensor sizes the plans use)")
            cases = [Case(f"{args.trace.name}", args.model, read_trace(args.trace),
                          read_trace(args.stats) if args.stats else None)]
        elif (TRAINED / "config.json").exists():
            cases = trained_cases(TRAINED)
        else:
            console.print("[yellow]no trained model (run `make model`): measuring a SYNTHETIC trace[/yellow]")
            cases = synthetic_cases(Path(tmp))
        rows = [row for case in cases for row in measure(case)]
    checks = verdicts(rows)
    print_tables(rows, checks)
    applies = [c for c in checks if c["goal_applies"]]
    met = [c for c in applies if c["goal_met"]]
    console.print(f"goal ({DEFAULT_CACHE_POLICY} <= 1.3x belady wherever lru > 1.5x belady): applies at "
                  f"{len(applies)} of {len(checks)} points, met at {len(met)}")
    for trace, place in dict.fromkeys((c["trace"], c["placement"]) for c in applies if not c["goal_met"]):
        misses = [c for c in applies if (c["trace"], c["placement"]) == (trace, place) and not c["goal_met"]]
        console.print(f"  missed, {trace}, {place}: " + ", ".join(
            f"{c['fraction']:.0%} ({c['ratio'][DEFAULT_CACHE_POLICY]:.2f}x)" for c in misses))
    speed = [r for r in rows if r["policy"] != "none" and r["seconds"] > 0]
    for p in POLICIES:
        acc = sum(r["expert_reads"] + r["cache_hits"] for r in speed if r["policy"] == p)
        sec = sum(r["seconds"] for r in speed if r["policy"] == p)
        console.print(f"{p}: {acc / sec / 1e6:.2f} M accesses/s through replay ({acc} accesses)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cache_bench.json").write_text(json.dumps({"rows": rows, "checks": checks}, indent=1))
    title = "expert cache: link bytes per decoded token against cache size (replayed, batch 1, log scale)"
    plot(rows, args.out / "cache_bench.png", title)
    if args.docs:
        plot(rows, Path(args.docs) / "cache-bench.png", title)
    console.print(f"wrote {args.out / 'cache_bench.json'}, {args.out / 'cache_bench.png'}"
                  + (f", {Path(args.docs) / 'cache-bench.png'}" if args.docs else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
