"""The rows of the arms that run on moe_offload's runtime: each batch measured (one warm-up run discarded,
then the measured runs, each started with an empty device cache), and the row made of those runs, the
runtime's counters and the settings read back from the model (readback.py).

Link traffic is what the runtime's LinkCounter counted during the decode steps (prefill excluded), never
derived from model size (docs/design.md, rule 6). `bf16_link_bytes_per_token` is what the same placement would have
read with every offloaded tensor at 2 bytes per element, from the measured runs' own routing (recorded only
where some offloaded tensor is not 2 bytes per element).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import torch

from . import timing   # timing.greedy looked up at each run: one instrument (or a stand-in) for every arm
from .arms import Arm
from .readback import applied_settings, device_resident_bytes
from .timing import Run, measured_link_bytes, timing_fields
from ..run.runtime import runtime_of
from ..run.host_compute import host_compute_stats


def measure(model, enc, runs: int, max_new_tokens: int, device: torch.device, describe, advance, *,
            compile: bool = False) -> list[Run]:
    """One warm-up run (discarded), then `runs` measured runs of the same batch. `compile`: each run through the
    compiled decode step (run/compiled.py, timing.greedy_generate); the warm-up compiles, and its first step's
    extra time is the row's `compile_s`."""
    from ..run.compiled import compile_kwargs, compile_seconds

    extra = compile_kwargs(model) if compile else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    measured = []
    with torch.no_grad():
        for i in range(runs + 1):
            describe("warm-up" if i == 0 else f"run {i}/{runs}")
            runtime_of(model).counter.reset()
            if i <= 1:   # the disk counter keeps every measured run (the warm-up's steps dropped); so do activations
                runtime_of(model).disk_counter.reset()
                runtime_of(model).activation_counter.reset()
            cache = runtime_of(model).cache
            if cache is not None:
                cache.reset()
            host_cache = runtime_of(model).host_cache
            if host_cache is not None:
                host_cache.reset()
            lookahead = runtime_of(model).lookahead
            if lookahead is not None:
                lookahead.reset()
            rt, calls = runtime_of(model), []
            record = i > 0 and needs_routing(rt.plan)
            if record:   # the routing of the measured runs, for bf16_link_bytes_per_token
                rt.recorder = calls.append
            try:
                if extra is None:
                    run = timing.greedy(model, enc, max_new_tokens, device)
                else:
                    run = timing.greedy_generate(model, enc, max_new_tokens, device, **extra)
                    compiled = compile_seconds(run.itl_s) if i == 0 else compiled   # the warm-up compiled
                    run.compiled, run.compile_s = True, compiled
            finally:
                if record:
                    rt.recorder = None
            run.decode_routing = calls[1:]              # the first call is the prefill
            if cache is not None:
                run.cache_hits, run.cache_misses = cache.policy.hits, cache.policy.misses
            if host_cache is not None:
                run.host_cache_hits, run.host_cache_misses = host_cache.policy.hits, host_cache.policy.misses
            if lookahead is not None:
                run.lookahead = lookahead.stats(len(run.itl_s) * enc["input_ids"].shape[0])
            if i > 0:
                measured.append(run)
            advance()
    return measured


def needs_routing(plan) -> bool:
    """Whether some offloaded tensor is not 2 bytes per element (quantized, fp32): only then does the bf16
    figure differ from the measured one and need the routing."""
    return any(t.tier != "device" and t.bytes != 2 * t.numel for t in plan.tensors)


def link_bytes_from_routing(plan, runs: Sequence[Run], c: int, *, bf16: bool = False) -> float:
    """Bytes per decoded token of the runs' recorded decode steps, accounted as accounting.py defines them
    for this placement: each step reads every offloaded dense tensor, the distinct offloaded experts its c
    tokens picked and the distinct embedding rows of its input. Stored bytes, this is the measured figure
    (a test checks it); `bf16`: with every offloaded tensor at 2 bytes per element, what the same placement
    would have read in bf16. A device cache's hits are not taken off (the bf16 experts would fill it
    differently)."""
    from ..planning.accounting import TokenBytes

    tensors = [replace(t, bytes=2 * t.numel) if bf16 else t for t in plan.tensors]
    embed = [t for t in tensors if t.role == "embedding" and t.tier != "device" and t.component == "language"]
    tb = TokenBytes.of([t for t in tensors if t not in embed])
    row = sum(t.bytes // t.shape[0] for t in embed)
    total = steps = 0
    for r in runs:
        for j, call in enumerate(r.decode_routing):
            picked = {layer: torch.unique(ids).tolist() for layer, ids in call.experts.items() if layer in tb.layers}
            host, disk = tb.bytes_for_token(picked)
            total += host + disk + row * torch.unique(r.token_ids[:, j]).numel()   # step j's input tokens
            steps += 1
    return total / (steps * c)


def _lookahead_fields(runs: list[Run], rt) -> dict:
    """lookahead, lookahead_hits / misses (summed over the measured runs), wasted and cancelled bytes per token (their
    means)."""
    from ..run.lookahead import lookahead_stats

    if rt.lookahead is None:
        return lookahead_stats(None, 0)
    per_run = [r.lookahead for r in runs if r.lookahead]
    return {"lookahead": rt.lookahead.distance, "lookahead_from": rt.lookahead.source,
            "lookahead_hits": sum(s["lookahead_hits"] for s in per_run),
            "lookahead_misses": sum(s["lookahead_misses"] for s in per_run),
            "lookahead_wasted_bytes_per_token": sum(s["lookahead_wasted_bytes_per_token"] for s in per_run) /
            max(len(per_run), 1),
            "lookahead_cancelled_bytes_per_token": sum(s["lookahead_cancelled_bytes_per_token"] for s in per_run) /
            max(len(per_run), 1),
            "lookahead_recall": per_run[-1]["lookahead_recall"] if per_run else {}}


def make_row(arm: Arm, c: int, runs: list[Run], model, plan, *, prompts: list[str], same_prompt: bool,
              max_new_tokens: int, link_gbps: float | None, model_name: str, budget_label: str) -> dict:
    rt = runtime_of(model)
    link = measured_link_bytes(c, runs)
    if rt.device.type == "cuda":
        device_bytes = torch.cuda.max_memory_allocated(rt.device)
    else:
        device_bytes = device_resident_bytes(model)
    settings = applied_settings(model, plan, resident=arm.policy is None)
    bf16_link = link_bytes_from_routing(plan, runs, c, bf16=True) if any(r.decode_routing for r in runs) else link
    row = {
        **timing_fields(arm.name, c, runs, max_new_tokens),
        "offloaded_bytes": sum(settings["host_bytes_by_role"].values()),   # read back from the arena
        "link_bytes_per_token": link,
        # of which read from the checkpoint by the disk tier (disk_tier.py), the rest over the host link
        "disk_read_bytes_per_token": rt.disk_counter.decode_bytes_per_token(c),
        "host_link_bytes_per_token": link - rt.disk_counter.decode_bytes_per_token(c),
        # of the host link's bytes, the activations host compute sent (run/host_compute.py); the rest were weights
        "link_activation_bytes_per_token": rt.activation_counter.decode_bytes_per_token(c),
        **host_compute_stats(rt.host_compute),
        "disk_staging_bytes": rt.disk.staging_bytes if rt.disk is not None else 0,
        "planned_link_bytes_per_token": plan.link_bytes_per_token(c),
        # the same placement and routing with every offloaded tensor at 2 bytes per element (quantized: what
        # bf16 would have read); the measured figure itself when nothing offloaded differs from 2 bytes
        "bf16_link_bytes_per_token": bf16_link,
        "cache_policy": None if rt.cache is None else rt.cache.policy_name,
        "cache_bytes": 0 if rt.cache is None else rt.cache.capacity_bytes,
        "cache_hits": sum(r.cache_hits for r in runs),       # over the measured runs' decode steps
        "cache_misses": sum(r.cache_misses for r in runs),
        "host_cache_policy": None if rt.host_cache is None else rt.host_cache.policy_name,
        "host_cache_bytes": 0 if rt.host_cache is None else rt.host_cache.capacity_bytes,
        "host_cache_hits": sum(r.host_cache_hits for r in runs),
        "host_cache_misses": sum(r.host_cache_misses for r in runs),
        **_lookahead_fields(runs, rt),
        "host_bytes": rt.host_bytes,
        "device_bytes": int(device_bytes),
        "same_prompt": same_prompt,
        "prompts": prompts,
        "mechanism": rt.mechanism,
        "experts": rt.compute.mode.value,             # eager loop or grouped kernels (run/grouped.py)
        "compile": any(r.compiled for r in runs),     # the decode step compiled (run/compiled.py)
        "compile_s": max((r.compile_s for r in runs), default=0.0),
        "model": model_name,
        "model_type": plan.model_type,
        "budget": budget_label,
        "settings": settings,
    }
    if link_gbps:
        row["link_ms_per_token"] = link / (link_gbps * 1e9) * 1e3
    return row
