"""`moe-offload serve` under an offloading budget, against `transformers serve` and vLLM's CPU build (issue 19).

Each server is a subprocess on a free port (benchmarks/serve_bench_peers.py), driven by the same client code:
1, 4 and 8 concurrent `openai` clients in threads, each streaming one completion of a distinct prompt (greedy,
EOS ignored, max_tokens fixed). Per level: one warm-up round, then ROUNDS measured rounds, every request of every
round a prompt of its own (the same prompts, in the same order, for every server). Figures per level:

- tok/s (wall): completion tokens of all clients / (last token - first request sent), the median round;
- decode tok/s: tokens after each client's first / (last token - the first first token), the median round;
- TTFT p50/p99: request sent -> first chunk with text; ITL p50/p99: gaps between a stream's chunks with text
  (chunks per token is recorded: a token whose text is held back, e.g. half a UTF-8 character, merges two gaps);
- link MiB/token: our /metrics `moe_offload_link_bytes_per_token` (our server is restarted for each level, so the
  gauge covers that level's decode steps, warm-up round included);
- client CPU ms/token: the CPU the benchmark's own openai clients spent per completion token (they share the
  machine's cores with the server under test);
- requests ok: finish_reason "length" with usage.completion_tokens == max_tokens, no error (none retried).

References in the same run, same budget, threads and prompts: `moe-offload bench --arms sparse-first
--concurrency 1,8` (the runtime's own batched greedy loop: tok_s_itl, itl_p50_ms) and the generate path
(model.generate timed per token). Targets: (1) 8 clients >= 2x the decode tok/s of 1; (2) serve at 8 within 10% of
bench c=8 tok_s_itl; (3) serve's single-request ITL p50 < 1.1x bench c=1 itl_p50; (4) no request lost.

Models: the trained model (models/trained-qwen3moe, `make model`; vLLM n/a unless its head_dim is 64) and a
make-tiny qwen3_moe, 8 layers x 16 experts top-4, hidden 512, head_dim 64, bf16 (~300 MiB, made once under
models/serve-bench/). Budget: --offload-gb = half the model's routed-expert bytes.

    .venv/bin/python benchmarks/serve_bench.py [--quick] [--threads 1] [--out-dir docs] [--no-vllm]

--quick: the random model only, 16 tokens, 1 round (writes bench-out/ unless --out-dir is given).
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
import serve_bench_peers as sp  # noqa: E402
import step_bench_peers as machine_info  # noqa: E402

GiB, MiB = 1 << 30, 1 << 20
LEVELS = (1, 4, 8)
TRAINED = "trained-qwen3moe"
RANDOM = "random-8x16"
RANDOM_SHAPE = dict(family="qwen3_moe", layers=8, experts=16, top_k=4, hidden=512, head_dim=64, dtype="bf16")


def ensure_random(folder: Path) -> Path:
    """The random model, made once (seconds) and reused."""
    from moe_offload.tiny.make import make_tiny

    return folder if (folder / "config.json").is_file() else make_tiny(folder, **RANDOM_SHAPE)


# --- one server, every level -------------------------------------------------------------------------------------

def run_levels(server: sp.Server, prompts: list[str], plan: dict, rounds: int, tokens: int, levels=LEVELS,
               metrics: bool = False) -> list[dict]:
    rows = []
    for c in levels:
        print(f"    {server.spec.name}: {c} client(s) ...", file=sys.stderr)
        before = machine_info.loadavg()
        got = [sp.client_round(server.base, server.model_id, [prompts[i] for i in plan[(c, r)]], plan[(c, r)],
                               tokens, server.spec.extra_body) for r in range(rounds + 1)]
        row = dict(sp.level_row(got[1:], got[0], c, tokens), loadavg=[before, machine_info.loadavg()])
        if metrics:
            m = server.metrics()
            row["link_bytes_per_token"] = m.get("moe_offload_link_bytes_per_token")
            row["server_metrics"] = {k: v for k, v in m.items() if "_created" not in k and "bucket" not in k}
        rows.append(row)
        print(f"      decode {row['tok_s_decode'] or 0:.1f} tok/s, ITL p50 {row['itl_p50_ms'] or 0:.1f} ms, "
              f"{row['requests_ok']}/{row['requests']} ok", file=sys.stderr)
    return rows


def warm_up(server: sp.Server) -> None:
    """One short request: a peer that loads its model on the first request (transformers serve) does it here."""
    sp.client_round(server.base, server.model_id, ["def warm_up():"], [-1], 4, server.spec.extra_body)


def peer_rows(name: str, make_spec, prompts, plan, rounds, tokens, logs: Path, restart_per_level: bool) -> list[dict]:
    """Every level of one peer: rows with the server's settings; a server that does not start is an error row."""
    groups = [(c,) for c in LEVELS] if restart_per_level else [LEVELS]
    rows = []
    for levels in groups:
        port = sp.free_port()
        spec = make_spec(port)
        try:
            with sp.Server(spec, port, logs / f"{name}-{'-'.join(map(str, levels))}.log") as server:
                warm_up(server)
                got = run_levels(server, prompts, plan, rounds, tokens, levels, metrics=restart_per_level)
            rows += [dict(r, server=spec.name, mode=spec.mode, start_s=server.start_s,
                          exit_code=server.exit_code, log=str(server.log_path.relative_to(ROOT))) for r in got]
        except (RuntimeError, OSError) as e:
            rows += [{"server": spec.name, "mode": spec.mode, "clients": c, "error": str(e)[-800:]} for c in levels]
    return rows


def agree(rows: list[dict], ref: str = "moe-offload serve") -> None:
    """Each peer row: the mean share of our text (same prompt, same level) that its text begins with. Greedy on
    bf16 random weights has near-ties, so engines part after a few tokens; on the trained model they should not."""
    ours = {r["clients"]: r.get("texts", {}) for r in rows if r["server"] == ref}
    for r in rows:
        mine, theirs = r.get("texts", {}), ours.get(r["clients"], {})
        shares = [_shared(theirs[k], mine[k]) for k in mine if k in theirs and k != -1]
        r["text_shared_with_ours"] = sum(shares) / len(shares) if shares and r["server"] != ref else None


def _shared(a: str, b: str) -> float:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return n / len(a) if a else 1.0


# --- one model ------------------------------------------------------------------------------------------------------

def measure_model(label: str, folder: Path, args, where: dict, logs: Path) -> dict:
    """Our server, then at once the runtime's references (so that they see the same load on a shared machine),
    then the peers."""
    import moe_offload as mo

    roles = mo.plan(folder, offload_gb=0).roles()
    off = roles["routed_expert"]["bytes"] / 2 / GiB
    hd, max_len, t, tokens = sp.head_dim(folder), min(256, sp.context_of(folder)), args.threads, args.tokens
    plan = sp.schedule(args.rounds, LEVELS)
    prompts = sp.prompt_pool(max(i for ids in plan.values() for i in ids) + 1)
    keys = ("num_hidden_layers", "num_local_experts", "num_experts", "num_experts_per_tok", "hidden_size",
            "moe_intermediate_size", "head_dim", "dtype", "vocab_size")
    out = {"folder": str(folder.relative_to(ROOT)), "expert_bytes": roles["routed_expert"]["bytes"], "offload_gb": off,
           "total_bytes": sum(r["bytes"] for r in roles.values()), "head_dim": hd, "max_model_len": max_len,
           "config": {k: v for k, v in json.loads((folder / "config.json").read_text()).items() if k in keys},
           "prompts": prompts, "schedule": {f"{c}x{r}": v for (c, r), v in plan.items()}}
    slug = label.split()[0]
    print(f"{label}: moe-offload serve (offload {off:.3f} GiB) ...", file=sys.stderr)
    rows = peer_rows(f"{slug}-ours", lambda p: sp.ours_spec(folder, p, t, off, max_len), prompts, plan, args.rounds,
                     tokens, logs, restart_per_level=True)
    print(f"{label}: moe-offload bench --concurrency 1,8, then generate ...", file=sys.stderr)
    out["bench"] = _ref(lambda: sp.bench_rows(folder, off, t, [prompts[i] for i in plan[(8, 1)]], (1, 8), tokens,
                                              args.bench_runs, ROOT / "bench-out" / "serve-bench-work" / slug))
    gen_prompts = [prompts[i] for r in range(1, args.rounds + 1) for i in plan[(1, r)]]
    out["generate"] = _ref(lambda: sp.generate_ref(folder, off, t, gen_prompts, tokens, 1))
    ours1 = next((r for r in rows if r["server"] == "moe-offload serve" and r["clients"] == 1), {})
    texts = {prompts[k]: v for k, v in ours1.get("texts", {}).items() if k >= 0}
    same = [texts[p] == g for p, g in out["generate"].get("texts", {}).items() if p in texts]
    out["generate"]["same_text_as_serve_c1"] = f"{sum(same)}/{len(same)}"
    if not args.no_transformers:
        print(f"{label}: transformers serve ...", file=sys.stderr)
        rows += peer_rows(f"{slug}-transformers", lambda p: sp.transformers_spec(folder, p, t), prompts, plan,
                          args.rounds, tokens, logs, restart_per_level=False)
    out["vllm"] = ("not run (--no-vllm)" if args.no_vllm else f"not available: {where['vllm']['missing']}"
                   if not where["vllm"]["ok"] else f"not applicable: head_dim {hd} (vLLM's CPU attention takes the "
                   "make-tiny models with head_dim 64 only)" if hd != 64 else "run")
    if out["vllm"] == "run":
        print(f"{label}: vLLM ...", file=sys.stderr)
        rows += peer_rows(f"{slug}-vllm", lambda p: sp.vllm_spec(where, folder, p, t, max_len), prompts, plan,
                          args.rounds, tokens, logs, restart_per_level=False)
    agree(rows)
    out["rows"] = rows
    return out


def _ref(run) -> dict | list:
    """A reference's result with the 1-minute load average before and after it, or its error."""
    before = machine_info.loadavg()
    try:
        got = run()
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        return {"error": str(e)[-800:], "loadavg": [before, machine_info.loadavg()]}
    load = [before, machine_info.loadavg()]
    return [dict(r, loadavg=load) for r in got] if isinstance(got, list) else dict(got, loadavg=load)


def targets(m: dict, tokens: int) -> list[dict]:
    """Issue 19's targets, each met / missed (None: not measured) with its figures."""
    ours = {r["clients"]: r for r in m["rows"] if r["server"] == "moe-offload serve" and "error" not in r}
    bench = {r["concurrency"]: r for r in m["bench"]} if isinstance(m.get("bench"), list) else {}
    one, eight = ours.get(1, {}).get("tok_s_decode"), ours.get(8, {}).get("tok_s_decode")
    b8, b1 = bench.get(8, {}).get("tok_s_itl"), bench.get(1, {}).get("itl_p50_ms")
    i1, gen = ours.get(1, {}).get("itl_p50_ms"), m.get("generate", {}).get("itl_p50_ms")
    served = [r for r in m["rows"] if r["server"] == "moe-offload serve"]
    total, ok = sum(r.get("requests", 0) for r in served), sum(r.get("requests_ok", 0) for r in served)
    errs = [r["error"] for r in served if "error" in r]
    checks = [
        ("(1) 8 clients >= 2x the decode tok/s of 1 client", one and eight and (eight >= 2 * one),
         one and eight and f"{eight:.1f} vs {one:.1f} tok/s = {eight / one:.2f}x"),
        ("(2) serve at 8 clients within 10% of bench --concurrency 8 (its tok_s_itl)", eight and b8 and eight >= 0.9 * b8,
         eight and b8 and f"{eight:.1f} vs {b8:.1f} tok/s = {eight / b8:.2f}x"),
        ("(3) serving adds < 10% to single-request ITL (serve c=1 ITL p50 vs bench c=1 itl_p50)",
         i1 and b1 and i1 < 1.1 * b1, i1 and b1 and f"{i1:.2f} vs {b1:.2f} ms = {(i1 / b1 - 1) * 100:+.0f}%"
         + (f" (generate path: {gen:.2f} ms)" if gen else "")),
        ("(4) no request lost (each: finish length, completion_tokens == max_tokens, no error)",
         not errs and total > 0 and ok == total, f"{ok}/{total} ok" + (f"; {errs[0][:200]}" if errs else ""))]
    return [{"goal": g, "met": bool(met) if value else None, "value": value or "not measured"}
            for g, met, value in checks]


# --- the report ------------------------------------------------------------------------------------------------------

COLUMNS = ("model", "server", "clients", "tok/s (wall)", "decode tok/s", "TTFT p50 / p99 ms", "ITL p50 / p99 ms",
           "link MiB/token", "client CPU ms/token", "requests ok", "text shared with ours")


def _f(v, fmt="{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def cells(label: str, r: dict) -> list[str]:
    if "error" in r:
        return [label, r["server"], str(r["clients"]), "error"] + [""] * 6 + [r["error"].splitlines()[-1][:90]]
    link = r.get("link_bytes_per_token")
    return [label, r["server"], str(r["clients"]), _f(r["tok_s_wall"]), _f(r["tok_s_decode"]),
            f"{_f(r['ttft_p50_ms'])} / {_f(r['ttft_p99_ms'])}", f"{_f(r['itl_p50_ms'], '{:.2f}')} / "
            f"{_f(r['itl_p99_ms'], '{:.2f}')}", _f(link and link / MiB, "{:.2f}"), _f(r.get("client_cpu_ms_per_token"), "{:.2f}"),
            f"{r['requests_ok']}/{r['requests']}", _f(r.get("text_shared_with_ours"), "{:.0%}")]


def ref_cells(label: str, m: dict) -> list[list[str]]:
    out = []
    for b in m["bench"] if isinstance(m.get("bench"), list) else []:
        out.append([label, "bench (runtime's own loop)", str(b["concurrency"]), _f(b["tok_s_wall"]),
                    _f(b["tok_s_itl"]) + " (c / ITL p50)", f"{_f(b['ttft_ms'])} / -",
                    f"{_f(b['itl_p50_ms'], '{:.2f}')} / p90 {_f(b['itl_p90_ms'], '{:.2f}')}",
                    _f(b["link_bytes_per_token"] / MiB, "{:.2f}"), "", "", ""])
    g = m.get("generate", {})
    if "itl_p50_ms" in g:
        out.append([label, "generate (model.generate)", "1", "", _f(g["tok_s_itl"]) + " (1 / ITL p50)",
                    f"{_f(g['ttft_p50_ms'])} / -", f"{_f(g['itl_p50_ms'], '{:.2f}')} / -", "", "", "",
                    f"{g['same_text_as_serve_c1']} (vs serve c=1)"])
    for k in ("bench", "generate"):
        if isinstance(m.get(k), dict) and "error" in m[k]:
            out.append([label, k, "", "error"] + [""] * 6 + [m[k]["error"].splitlines()[-1][:90]])
    return out


def all_rows(result: dict) -> list[list[str]]:
    rows = []
    for label, m in result["models"].items():
        if "error" in m:
            rows.append([label, "-", "", "error"] + [""] * 6 + [m["error"]])
            continue
        rows += [cells(label, r) for r in m["rows"]] + ref_cells(label, m)
    return rows


def print_report(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, width=max(Console().width, 170))
    t = Table(title=f"serve, {result['settings']['tokens']} tokens per request, greedy, streaming", title_justify="left")
    for c in COLUMNS:
        t.add_column(c, justify="left" if c in ("model", "server") else "right")
    for row in all_rows(result):
        t.add_row(*row)
    console.print(t)
    for label, m in result["models"].items():
        for g in m.get("targets", []):
            mark = "n/a" if g["met"] is None else "met" if g["met"] else "[red]missed[/red]"
            console.print(f"  {label}: {g['goal']}: {g['value']} -> {mark}")


def markdown(result: dict) -> str:
    m, s = result["machine"], result["settings"]
    lines = ["# Serving benchmark (issue 19)", "",
             f"`benchmarks/serve_bench.py{' --quick' if s['quick'] else ''}` on {m['cpu']} ({m['cores']} cores), torch "
             f"{m['torch']}, transformers {m['transformers']}, vLLM {m.get('vllm') or '-'}, {m['date']}"
             f"{', tree ' + m['tree'] if m.get('tree') else ''}; {s['threads']} torch thread(s) per server "
             f"({s['threads_how']}); {s['tokens']} tokens per request (greedy, EOS ignored, streamed), clients "
             f"{', '.join(map(str, s['levels']))}, a warm-up round and {s['rounds']} measured round(s) per level, "
             f"every request a distinct prompt (the same ones for every server); the run took "
             f"{result['wall_s'] / 60:.1f} min; 1-minute load average {m['loadavg_min']:.2f} to {m['loadavg_max']:.2f}.", "",
             "\n\n".join(x.strip() for x in __doc__.split("\n\n")[1:4]), "",
             "| " + " | ".join(COLUMNS) + " |", "|---|---|" + "---:|" * (len(COLUMNS) - 2)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in all_rows(result)]
    for label, mm in result["models"].items():
        if "error" in mm:
            continue
        cfg = mm["config"]
        lines += ["", f"## {label}", "",
                  f"`{mm['folder']}`: {cfg.get('num_hidden_layers')} layers, {cfg.get('num_local_experts') or cfg.get('num_experts')} "
                  f"experts top-{cfg.get('num_experts_per_tok')}, hidden {cfg.get('hidden_size')}, head_dim {mm['head_dim']}, "
                  f"{mm['total_bytes'] / MiB:.0f} MiB ({mm['expert_bytes'] / MiB:.0f} MiB routed experts); ours: "
                  f"`--offload-gb {mm['offload_gb']:.4g}` (half the expert bytes), `--max-model-len {mm['max_model_len']}`. "
                  f"vLLM: {mm['vllm']}.", ""]
        for name in dict.fromkeys(r["server"] for r in mm["rows"]):
            rs = [r for r in mm["rows"] if r["server"] == name and "error" not in r]
            procs = dict.fromkeys((r["start_s"], r["exit_code"]) for r in rs)   # one per server process
            lines.append(f"- {name}: {rs[0]['mode'] if rs else '-'}; " + ", ".join(
                f"ready in {st:.1f} s, exit status {ex} on SIGTERM" for st, ex in procs) + "; load average per level "
                + ", ".join("-".join(f"{x:.1f}" for x in r["loadavg"]) for r in rs if "loadavg" in r))
        shaky = [f"{r['server']} c={r['clients']} ({min(r['tok_s_decode_rounds']):.0f}-{max(r['tok_s_decode_rounds']):.0f})"
                 for r in mm["rows"] if len(r.get("tok_s_decode_rounds") or []) > 1
                 and max(r["tok_s_decode_rounds"]) - min(r["tok_s_decode_rounds"]) > 0.25 * r["tok_s_decode"]]
        lines += ["- Unsteady levels (decode tok/s of the rounds spread by more than 25% of the median; range): "
                  + (", ".join(shaky) if shaky else "none") + ".", ""]
        for g in mm["targets"]:
            mark = "n/a" if g["met"] is None else "**met**" if g["met"] else "**missed**"
            lines.append(f"- Target {g['goal']}: {g['value']} -> {mark}")
        bad = [f"{r['server']} c={r['clients']}: {r.get('errors') or r.get('short')}" for r in mm["rows"]
               if "error" not in r and r["requests_ok"] != r["requests"]]
        lines += [f"- Requests not ok: {'; '.join(bad)}" if bad else "- Every request of every server was ok."]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [k for k, m in result["models"].items() if "error" not in m]
    fig, axes = plt.subplots(2, max(1, len(models)), figsize=(6.5 * max(1, len(models)), 7.5), squeeze=False)
    colours = {"moe-offload serve": "tab:blue", "transformers serve": "tab:orange", "vLLM": "tab:purple"}
    for j, label in enumerate(models):
        m = result["models"][label]
        for server, colour in colours.items():
            rows = [r for r in m["rows"] if r["server"] == server and "error" not in r]
            if rows:
                xs = [r["clients"] for r in rows]
                axes[0][j].plot(xs, [r["tok_s_decode"] or 0 for r in rows], "o-", color=colour, label=server)
                axes[1][j].plot(xs, [r["itl_p50_ms"] or 0 for r in rows], "o-", color=colour, label=server)
        bench = m["bench"] if isinstance(m.get("bench"), list) else []
        if bench:
            xs = [b["concurrency"] for b in bench]
            axes[0][j].plot(xs, [b["tok_s_itl"] for b in bench], "x--", color="black", label="bench (runtime)")
            axes[1][j].plot(xs, [b["itl_p50_ms"] for b in bench], "x--", color="black", label="bench (runtime)")
        axes[0][j].set(title=f"{label}: decode tok/s, all clients", xlabel="clients", ylabel="tokens / s")
        axes[1][j].set(title=f"{label}: ITL p50", xlabel="clients", ylabel="ms")
        for ax in (axes[0][j], axes[1][j]):
            ax.set_xticks(list(LEVELS))
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    s = result["settings"]
    fig.suptitle(f"serve: {s['tokens']} tokens per request, greedy, {s['threads']} torch thread(s), "
                 f"{result['machine']['cpu']} ({result['machine']['cores']} cores)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- the run ---------------------------------------------------------------------------------------------------------

def measure(args) -> dict:
    begin = time.monotonic()
    where = machine_info.engines()
    logs = ROOT / "bench-out" / "serve-bench-logs"
    loads = [machine_info.loadavg()]
    models = {}
    for label in [RANDOM] if args.quick else [TRAINED, RANDOM]:
        folder = ROOT / "models" / TRAINED if label == TRAINED else ensure_random(ROOT / "models" / "serve-bench" / RANDOM)
        if not (folder / "model.safetensors").is_file():
            models[label] = {"error": f"{folder} is missing: run `make model` first"}
            continue
        models[label] = measure_model(label, folder, args, where, logs)
        loads.append(machine_info.loadavg())
    return {"machine": {**machine_info.machine(where), "loadavg_min": min(loads), "loadavg_max": max(loads)},
            "settings": {"threads": args.threads, "tokens": args.tokens, "rounds": args.rounds, "levels": LEVELS,
                         "bench_runs": args.bench_runs, "quick": args.quick,
                         "threads_how": "OMP_NUM_THREADS (+MKL_NUM_THREADS) in every server's environment; "
                                        "vLLM with VLLM_CPU_OMP_THREADS_BIND=nobind; bench --threads; the "
                                        "generate child torch.set_num_threads"},
            "models": models, "wall_s": time.monotonic() - begin}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the random model only, 16 tokens, 1 round: a smoke run")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of every server and reference (default 1)")
    ap.add_argument("--tokens", type=int, help="max_tokens of every request (default 64; 16 with --quick)")
    ap.add_argument("--rounds", type=int, help="measured rounds per level (default 3; 1 with --quick)")
    ap.add_argument("--bench-runs", type=int, help="bench --runs (default 2; 1 with --quick)")
    ap.add_argument("--out-dir", type=Path, help="where the .md/.json/.png go (default docs/; bench-out/ with --quick)")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--from-json", type=Path, help="measure nothing: rewrite the report of a saved serve_bench.json")
    args = ap.parse_args(argv)
    args.tokens = args.tokens or (16 if args.quick else 64)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.bench_runs = args.bench_runs or (1 if args.quick else 2)
    out = args.out_dir or (ROOT / ("bench-out" if args.quick else "docs"))
    result = json.loads(args.from_json.read_text()) if args.from_json else measure(args)
    for mm in result["models"].values():      # judged again: a --from-json report has today's definitions
        if "rows" in mm:
            mm["targets"] = targets(mm, result["settings"]["tokens"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve_bench.json").write_text(json.dumps(result, indent=1, default=str))   # first: --from-json
    print_report(result)
    (out / "serve_bench.md").write_text(markdown(result))
    plot(result, out / "serve-bench.png")
    print(f"wrote {out}/serve_bench.{{json,md}}, serve-bench.png ({result['wall_s']:.0f} s measuring)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
