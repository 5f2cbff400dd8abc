"""Host compute on released models, predicted: decode ms per token streaming experts vs computing them on the host.

For Qwen3-30B-A3B, gpt-oss-120b and DeepSeek-V3 (published hyper-parameters, moe_offload.model.published; nothing
downloaded, planning reads config.json alone), each planned on a 24 GB and an 80 GB device (`device_memory_gb` 24
and 80, the planner's 2 GiB reserve, host memory unbounded: no disk tier), on PCIe 4 (25 GB/s) and PCIe 5 (50 GB/s)
links and hosts of 50 and 200 GB/s, 256 decode tokens of uniform random routing (seeded) are replayed
(routing/replay_compute.py) under three expert-compute modes: streaming (`device`), host compute (`host`), the cost
model's choice per layer step (`auto`), and host compute with a device-side expert cache, at two hit rates: a heat
cache on the same uniform routing, and the hit rate measured on the model trained here (docs/results.md, "Expert
cache policies", held-out code, heat) at the same share of the offloaded experts.

These are predictions of the cost model (planning/cost_model.py), not measurements. The assumptions are in
ASSUMPTIONS below and in the markdown this writes.

    .venv/bin/python benchmarks/host_compute_predict.py [--tokens 256] [--out bench-out] [--doc docs]

Writes bench-out/host_compute_predict.json and docs/host_compute_predict_bench.md.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import moe_offload as mo
from moe_offload.model.published import write
from moe_offload.planning.cost_model import ExpertCompute, Hardware
from moe_offload.planning.placement import GiB, format_bytes
from moe_offload.routing.cache_policy import make_cache
from moe_offload.routing.replay_compute import FORMULA, compute_shape, replay_compute

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"qwen3-30b-a3b": "Qwen3-30B-A3B", "gpt-oss-120b": "gpt-oss-120b", "deepseek-v3": "DeepSeek-V3"}
DEVICES = {24: 1000.0, 80: 2000.0}          # device memory GiB -> its memory bandwidth, GB/s
LINKS = {"PCIe 4": 25.0, "PCIe 5": 50.0}    # GB/s
HOSTS = {50: 500.0, 200: 1000.0}            # host memory GB/s -> the experts kernels' FLOP rate, GFLOP/s
CACHE_GIB = {24: 4.0, 80: 16.0}             # device cache, taken out of the device's budget (a reserve of 2 + it)
RESERVE_GB = 2.0
GOAL = dict(model="qwen3-30b-a3b", device_gb=24, link="PCIe 4", host_gbps=80.0, host_gflops=500.0)
ASSUMPTIONS = [
    "device memory 24 and 80 GiB (`device_memory_gb`), the planner's 2 GiB reserve for activations and KV cache; "
    "host memory unbounded (every offloaded byte in RAM, no disk tier)",
    "device memory bandwidth 1000 GB/s on the 24 GB card, 2000 GB/s on the 80 GB card; the device's FLOPs not "
    "limiting (decode streaming is link-bound)",
    "links: PCIe 4 x16 25 GB/s, PCIe 5 x16 50 GB/s, both directions",
    "host: 50 GB/s with 0.5 TFLOP/s for the experts kernels (a desktop), 200 GB/s with 1 TFLOP/s (a server); the "
    "goal's 80 GB/s host with 0.5 TFLOP/s. These FLOP rates are assumptions, not measured",
    "routing: 256 decode tokens, each layer's top-k drawn uniformly without replacement (numpy seed 0); batch 1",
    "device cache: 4 GiB (24 GB card) or 16 GiB (80 GB card) out of the device budget, so the plan with a cache "
    "offloads that much more. `uniform`: a heat cache replayed on the uniform routing, admissions included (a miss "
    "the cache takes in streams over the link to fill its pages, as the runtime does); `measured`: each offloaded "
    "pick a hit with the probability measured on the trained model (4 layers x 32 experts, docs/results.md, "
    "held-out code, heat) at the same share of the offloaded experts (linear between measured shares, from 0 at "
    "0%), hits independent, and no admission traffic (the measured table gives hits, not admissions: an optimistic "
    "column). A rate measured on a 32-expert toy model is the only measured rate there is; it does not say what a "
    "128- or 256-expert model's routing does",
    "not modelled: attention and KV-cache reads and compute, the routers, prefill, disk, overlap between layers",
]


def measured_hit_rates(text: str, kind: str = "code", policy: str = "heat") -> list[tuple[float, float]]:
    """(share of the offloaded experts cached, hit rate) from results.md's cache table: 1 - bytes / bytes uncached."""
    uncached = float(re.search(r"no cache: ([\d.]+) KiB per token", text).group(1))
    header = re.search(r"^\| cache \(experts\) \|(.*)$", text, re.M).group(1)
    col = [c.strip() for c in header.split("|")].index(policy)
    out = []
    for share, cells in re.findall(rf"^\| {kind} (\d+)% \(\d+\) \|(.*)$", text, re.M):
        kib = float(cells.split("|")[col].strip().strip("*"))
        out.append((int(share) / 100, 1.0 - kib / uncached))
    if len(out) < 3:
        raise SystemExit(f"docs/results.md: the {kind} rows of the cache table were not found")
    return out


def hit_rate_at(points: list[tuple[float, float]], share: float) -> float:
    xs, ys = [0.0] + [p for p, _ in points], [0.0] + [h for _, h in points]
    return float(np.interp(share, xs, ys))


class FixedRateCache:
    """A stand-in for a device cache: each access a hit with probability `rate` (seeded), for replay's walk."""

    def __init__(self, rate: float, seed: int = 1):
        self.rate, self.rng, self.hits, self.misses = rate, np.random.default_rng(seed), 0, 0

    def begin_step(self):
        pass

    def contents(self):
        return set()

    def access(self, key, nbytes) -> bool:
        hit = bool(self.rng.random() < self.rate)
        self.hits, self.misses = self.hits + hit, self.misses + (not hit)
        return hit


def uniform_ids(tb, tokens: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    e, k, layers = tb.num_experts, tb.top_k, len(tb.layers)
    picks = np.argsort(rng.random((tokens, layers, e)), axis=2)[:, :, :k]
    return np.sort(picks, axis=2).astype(np.int16)


def hardware(device_gb: int, link: float, host_gbps: float, host_gflops: float) -> Hardware:
    return Hardware(host_bytes_per_s=host_gbps * 1e9, host_flops_per_s=host_gflops * 1e9,
                    link_bytes_per_s=link * 1e9, device_bytes_per_s=DEVICES[device_gb] * 1e9)


def routed_offloaded(plan) -> int:
    return sum(t.offloaded_bytes for t in plan.tensors if t.role == "routed_expert")


def predict(tokens: int, rates: list[tuple[float, float]]) -> tuple[list[dict], dict]:
    rows, plans = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODELS:
            folder = write(name, Path(tmp) / name)
            for device_gb in DEVICES:
                plain = mo.plan(folder, device_memory_gb=device_gb, reserve_gb=RESERVE_GB)
                cached = mo.plan(folder, device_memory_gb=device_gb, reserve_gb=RESERVE_GB + CACHE_GIB[device_gb])
                plans[(name, device_gb)] = (plain, cached)
        combos = [(name, d, link, host, HOSTS[host]) for name in MODELS for d in DEVICES for link in LINKS
                  for host in HOSTS]
        combos.append((GOAL["model"], GOAL["device_gb"], GOAL["link"], GOAL["host_gbps"], GOAL["host_gflops"]))
        shapes = {}
        for i, (name, device_gb, link, host_gbps, host_gflops) in enumerate(combos):
            plain, cached = plans[(name, device_gb)]
            if (name, device_gb) not in shapes:
                s_plain, s_cached = compute_shape(plain), compute_shape(cached)
                shapes[(name, device_gb)] = (s_plain, s_cached, uniform_ids(s_plain.tb, tokens),
                                             uniform_ids(s_cached.tb, tokens))
            s_plain, s_cached, ids, ids_c = shapes[(name, device_gb)]
            hw = hardware(device_gb, LINKS[link], host_gbps, host_gflops)
            cache_bytes = int(CACHE_GIB[device_gb] * GiB)
            share = min(1.0, cache_bytes / routed_offloaded(cached)) if routed_offloaded(cached) else 0.0
            rate = hit_rate_at(rates, share)
            run = {mode.value: replay_compute(s_plain, ids, mode, hw) for mode in ExpertCompute}
            if routed_offloaded(cached):
                heat_cache = make_cache("heat", cache_bytes)
                heat = replay_compute(s_cached, ids_c, ExpertCompute.HOST, hw, cache=heat_cache)
                fixed = FixedRateCache(rate)
                measured = replay_compute(s_cached, ids_c, ExpertCompute.HOST, hw, cache=fixed)
            else:
                heat = measured = fixed = heat_cache = None
            stream, host = run["device"].expected_ms_per_token, run["host"].expected_ms_per_token
            rows.append({
                "model": name, "label": MODELS[name], "device_gb": device_gb, "device_gbps": DEVICES[device_gb],
                "link": link, "link_gbps": LINKS[link], "host_gbps": host_gbps, "host_gflops": host_gflops,
                "goal_row": i == len(combos) - 1,
                "offloaded_bytes": plain.offloaded_bytes, "total_bytes": plain.total_bytes,
                "streaming_ms": stream, "host_ms": host, "auto_ms": run["auto"].expected_ms_per_token,
                "host_over_streaming": stream / host if host else None,
                "cache_bytes": cache_bytes, "cache_share_of_offloaded_experts": share,
                "host_cache_uniform_ms": heat.expected_ms_per_token if heat else None,
                "cache_hit_rate_uniform": heat_cache.hits / max(1, heat_cache.hits + heat_cache.misses)
                if heat_cache else None,
                "host_cache_measured_ms": measured.expected_ms_per_token if measured else None,
                "cache_hit_rate_measured": rate if measured else None,
                "modes": {m: r.to_dict() for m, r in run.items()},
                "host_cache_uniform": heat.to_dict() if heat else None,
                "host_cache_measured": measured.to_dict() if measured else None,
            })
            print(f"{MODELS[name]:14} {device_gb} GB {link} host {host_gbps:g} GB/s: streaming {stream:8.2f} ms, "
                  f"host {host:7.2f} ms, auto {run['auto'].expected_ms_per_token:7.2f} ms", file=sys.stderr)
    return rows, plans


def goal_at(tokens: int, host_gflops: float) -> float:
    """The goal row's host-compute ms per token at another host FLOP rate (is the goal memory-bound?)."""
    with tempfile.TemporaryDirectory() as tmp:
        plan = mo.plan(write(GOAL["model"], Path(tmp) / "m"), device_memory_gb=GOAL["device_gb"],
                       reserve_gb=RESERVE_GB)
    shape = compute_shape(plan)
    hw = hardware(GOAL["device_gb"], LINKS[GOAL["link"]], GOAL["host_gbps"], host_gflops)
    return replay_compute(shape, uniform_ids(shape.tb, tokens), ExpertCompute.HOST, hw).expected_ms_per_token


def fmt(x: float | None, digits: int = 1) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def markdown(rows: list[dict], tokens: int, rates: list[tuple[float, float]], goal: dict) -> str:
    g = next(r for r in rows if r["goal_row"])
    admitted = g["host_cache_uniform"]["link_weight_bytes_per_token"]   # streamed beside host compute
    lines = [
        "# Host compute on released models: predicted decode time per token",
        "",
        "**These are predictions, not measurements**: the cost model (`planning/cost_model.py`) applied by",
        "`replay` (`routing/replay_compute.py`) to plans of the released configs and a synthetic routing, for",
        "machines described by their rates. Written by `benchmarks/host_compute_predict.py`; every row's figures",
        "are in `bench-out/host_compute_predict.json`. `moe-offload replay MODEL --trace T --expert-compute host",
        "--link-gbps X --host-gbps X --host-gflops X --device-gbps X` gives the same for any model and trace.",
        "",
        "The formula (per decode token, batch 1):",
        "",
        "```text",
        "ms/token = sum over routed layer steps of the chosen side's time",
        "         + resident dense bytes / device_bw + offloaded dense bytes / link_bw",
        "host compute  max(max(B / host_bw, F / host_flops) + A / link_bw,  S / link_bw + D / device_bw)",
        "streaming     max((B + S) / link_bw,  D / device_bw) + F / device_flops",
        "```",
        "",
        "B: the step's host-side experts' offloaded bytes; F: 2 x their parameters (one per pick); A: the hidden",
        "state in and each host-side pick's output back (hidden size x 2 B x (1 + picks)); S: the offloaded bytes",
        "that stream in every mode (a miss the device cache admits; an expert partly on the device); D: the stored",
        "bytes of the step's device-side experts (resident, or device-cache hits), which the device computes in",
        "either case, overlapping the other side. `auto` takes the side the cost model chooses per step.",
        "",
        "Assumptions:",
        "",
        *[f"- {a}" for a in ASSUMPTIONS],
        "",
        f"Measured hit rates used (trained model, held-out code, heat; share of offloaded experts cached -> hit "
        f"rate): {', '.join(f'{s:.0%} -> {h:.1%}' for s, h in rates)}.",
        "",
        "| model | device | link | host | offloaded | streaming ms | host ms | auto ms | host + cache ms (uniform hits) "
        "| host + cache ms (measured rate) | host / streaming speed-up |",
        "| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        off = (format_bytes(r["offloaded_bytes"]) if r["offloaded_bytes"] else "nothing (fits)")
        uni = (f"{fmt(r['host_cache_uniform_ms'])} ({r['cache_hit_rate_uniform']:.0%})"
               if r["host_cache_uniform_ms"] is not None else "")
        mea = (f"{fmt(r['host_cache_measured_ms'])} ({r['cache_hit_rate_measured']:.0%})"
               if r["host_cache_measured_ms"] is not None else "")
        speed = f"{r['host_over_streaming']:.2f}x" if r["offloaded_bytes"] else "-"
        label = f"**{r['label']}** (goal row)" if r["goal_row"] else r["label"]
        lines.append(f"| {label} | {r['device_gb']} GB, {r['device_gbps']:g} GB/s | {r['link']} "
                     f"({r['link_gbps']:g} GB/s) | {r['host_gbps']:g} GB/s, {r['host_gflops'] / 1e3:g} TFLOP/s | "
                     f"{off} | {fmt(r['streaming_ms'])} | {fmt(r['host_ms'])} | {fmt(r['auto_ms'])} | {uni} | {mea} "
                     f"| {speed} |")
    lines += [
        "",
        "Cache columns: the cache is 4 GiB on the 24 GB card and 16 GiB on the 80 GB card, taken from the device's",
        "budget (so more is offloaded than in the other columns); in brackets the share of offloaded picks it",
        "serves. A model that fits leaves nothing to offload: its row is the device alone (no cache column).",
        "Under uniform routing a cache hits about its share of the offloaded experts, no more than the same bytes",
        "made resident would serve, and heat keeps admitting (each admission streams the expert over the link: on",
        f"Qwen3-30B-A3B, 24 GB, {admitted / 1e9:.2f} GB per token, beside the host's work), so with a fast host it costs more than it saves; on a slow host the",
        "admissions stream while the host computes the rest, and the two sides together beat either alone. Only",
        "skewed routing (the measured rate) makes the cache itself pay.",
        "",
        "Models: `moe_offload.model.published` (Qwen3-30B-A3B in bf16, gpt-oss-120b with MXFP4 experts, DeepSeek-V3 in",
        "FP8 with 128x128 block scales, as released); the bundled `make-tiny --like` configs (`tiny/like/`) have",
        "qwen3-30b-a3b but neither gpt-oss-120b nor DeepSeek-V3, so all three come from `published`.",
        "",
        f"**Goal** (host-compute decode predicted at least 2x streaming for Qwen3-30B-A3B on a 24 GB PCIe 4 device "
        f"with an 80 GB/s host): predicted {goal['streaming_ms']:.1f} ms streaming against {goal['host_ms']:.1f} ms "
        f"host compute, {goal['host_over_streaming']:.2f}x: **{'holds' if goal['holds'] else 'does not hold'}** "
        "(a prediction; measuring it needs that machine). It is memory-bound: at 0.1 TFLOP/s for the host "
        f"instead of 0.5, host compute is predicted at {goal['host_ms_at_0.1_tflops']:.1f} ms.",
        "",
        f"Replayed: {tokens} decode tokens per configuration.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--out", type=Path, default=ROOT / "bench-out")
    ap.add_argument("--doc", type=Path, default=ROOT / "docs")
    args = ap.parse_args()
    start = time.perf_counter()
    rates = measured_hit_rates((ROOT / "docs" / "results.md").read_text())
    rows, _ = predict(args.tokens, rates)
    g = next(r for r in rows if r["goal_row"])
    goal = {**{k: g[k] for k in ("streaming_ms", "host_ms", "host_over_streaming")},
            "holds": g["host_over_streaming"] >= 2.0, "configuration": GOAL,
            "host_ms_at_0.1_tflops": goal_at(args.tokens, 100.0)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host_compute_predict.json").write_text(json.dumps(
        {"predictions_not_measurements": True, "formula": FORMULA, "assumptions": ASSUMPTIONS, "tokens": args.tokens,
         "measured_hit_rates": rates, "goal": goal, "rows": rows}, indent=1))
    (args.doc / "host_compute_predict_bench.md").write_text(markdown(rows, args.tokens, rates, goal))
    print(f"goal (host compute >= 2x streaming, Qwen3-30B-A3B, 24 GB, PCIe 4, host 80 GB/s): "
          f"{goal['host_over_streaming']:.2f}x, {'holds' if goal['holds'] else 'does not hold'} "
          f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
