"""One load of benchmarks/gpu_check.py and its checks: placement of the offloaded weights (slabs, pinning, UVA
views, host tensors, disk placeholders), device memory against the plan, link bytes of a recorded generation
against `replay` of its trace, the audit; then greedy tokens and tok/s, and the release of the runtime."""

from __future__ import annotations

import gc
import math
import signal
import statistics
import time
from pathlib import Path

from gpu_check_harness import MIB, Checks


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _allocated(dev) -> int:
    import torch

    return torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0


def _generate(model, ids, n: int):
    return model.generate(ids, attention_mask=ids.new_ones(ids.shape), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False)


def _tok_s(model, ids, n: int, runs: int, dev) -> tuple[float, list[float]]:
    _generate(model, ids, n)                                   # warm-up
    times = []
    for _ in range(runs):
        _sync(dev)
        t0 = time.perf_counter()
        _generate(model, ids, n)
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return n / statistics.median(times), times


def release_uninterrupted(model) -> None:
    """_release with SIGALRM held back until it is done: a step timeout must not cut the unregistering of pinned
    slabs short (a freed-but-registered range makes a later cudaHostRegister of reused addresses fail)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    try:
        _release(model)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})


def _release(model) -> None:
    """Detach the runtime, unregister its pinned slabs and close its disk tier; the memory goes when the
    model is collected."""
    rt = getattr(model, "moe_offload_runtime", None)
    if rt is not None:
        rt.detach()
        rt.arena.release()
        if rt.disk is not None:
            rt.disk.close()


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def staging_bytes(rt) -> int:
    """Device buffers the runtime reuses for offloaded weights: gathered expert rows, the prefetch ring of
    dense tensors, dequantized weights. (The same buffers measure/readback.py's device_resident_bytes adds.)"""
    bufs = list(getattr(rt, "_staging", {}).values())
    bufs += list(getattr(getattr(rt, "_dense", None), "ring", []))
    if rt.dequantizer is not None:
        bufs += rt.dequantizer.buffers()
    return _nbytes(b for b in bufs if b.device.type == rt.device.type)


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-9)


# --- one load ----------------------------------------------------------------------------------------------

def _placement(label: str, case: dict, model, plan, rt, dev, checks: Checks) -> None:
    """Where the offloaded weights are: slabs, pinning, UVA views or host tensors, disk placeholders."""
    params = dict(model.named_parameters(remove_duplicate=False))
    host = [t.name for t in plan.tensors if t.tier == "host" and t.name in params]
    disk = [t.name for t in plan.tensors if t.tier == "disk" and t.name in params]
    if plan.host_bytes:
        arena, want = rt.host_bytes, plan.host_bytes
        checks.check(f"{label}: host arena bytes == plan host bytes within 1%", abs(arena - want) <= 0.01 * want,
                     f"arena {arena} B, plan {want} B, ratio {arena / want:.5f}")
        bad_owner = [n for n in host if not rt.arena.owns(params[n])]
        checks.check(f"{label}: host-tier params lie in the host slabs (arena.owns)", not bad_owner,
                     f"{len(host)} params; not in a slab: {bad_owner[:3]}")
    if disk:
        held = [n for n in disk if params[n].device.type != "meta"]
        checks.check(f"{label}: disk-tier params hold no memory (meta placeholders)", not held,
                     f"{len(disk)} params; holding memory: {held[:3]}")
    if not plan.host_bytes:
        return
    if dev.type != "cuda":
        checks.skip(f"{label}: pinned slabs / CUDA views", "no CUDA device")
        return
    unregistered = [s.region for s in rt.arena.slabs if not s.registered]
    checks.check(f"{label}: every slab is cudaHostRegister'ed", not unregistered,
                 f"{len(rt.arena.slabs)} slabs; unregistered: {unregistered[:3]}")
    unpinned = [s.region for s in rt.arena.slabs if not s.host.is_pinned()]
    checks.check(f"{label}: every slab reads as pinned (Tensor.is_pinned)", not unpinned, f"not pinned: {unpinned[:3]}")
    if case["backend"] == "uva":
        not_cuda = [n for n in host if not params[n].is_cuda]
        checks.check(f"{label}: host-tier params are CUDA tensors (UVA views)", not not_cuda, f"not CUDA: {not_cuda[:3]}")
        views = [s for s in rt.arena.slabs if s.view is None or s.view.data_ptr() != s.host.data_ptr()]
        checks.check(f"{label}: each slab's device view aliases its host address", not views,
                     f"bad: {[s.region for s in views][:3]}")
    else:
        on_cuda = [n for n in host if params[n].is_cuda]
        checks.check(f"{label}: prefetch keeps host-tier params in host memory", not on_cuda, f"on CUDA: {on_cuda[:3]}")


def _memory(label: str, when: str, model, plan, rt, dev, before: int, slack: int, checks: Checks) -> int:
    """memory_allocated growth since before the load <= plan resident + cache pages + staging + slack."""
    if dev.type != "cuda":
        checks.skip(f"{label}: device memory {when} within plan + cache + staging", "no CUDA device")
        return 0
    _sync(dev)
    grown = _allocated(dev) - before
    cache = rt.cache.device_bytes if rt.cache is not None else 0
    staging = staging_bytes(rt)
    limit = plan.resident_bytes + cache + staging + slack
    checks.check(f"{label}: device memory {when} within plan + cache + staging (memory_allocated)", grown <= limit,
                 f"grew {grown / MIB:.1f} MiB; resident {plan.resident_bytes / MIB:.1f} + cache {cache / MIB:.1f} + "
                 f"staging {staging / MIB:.1f} + slack {slack / MIB:.0f} MiB; offloaded {plan.offloaded_bytes / MIB:.1f} MiB")
    return grown


def _link_vs_replay(label: str, model, plan, rt, folder: Path, tmp: Path, args, checks: Checks, out: dict) -> None:
    """Record one generation as a trace while the runtime counts; replay the trace under the same plan (and
    cache); both must give the same bytes per decode token, and the same hits and misses."""
    from moe_offload.loading.loader import load_tokenizer
    from moe_offload.planning.placement import GiB
    from moe_offload.measure.profile import record, trace_header
    from moe_offload.prompts import PROMPTS
    from moe_offload.routing.replay import replay
    from moe_offload.formats.traces import TraceWriter, read_trace

    path = tmp / f"trace-{label.replace('/', '-')}.jsonl"
    rt.counter.reset()
    rt.disk_counter.reset()
    if rt.cache is not None:
        rt.cache.reset()      # replay starts from an empty cache with no history: so must the runtime
    with TraceWriter(path, trace_header(plan, f"gpu_check {label}")) as writer:
        record(model, load_tokenizer(folder), [PROMPTS[1]], writer, max_new_tokens=args.trace_tokens,
               ignore_eos=True)
    trace = read_trace(path)
    kw = {} if rt.cache is None else dict(cache_gb=rt.cache.capacity_bytes / GiB, cache_policy=rt.cache.policy_name)
    want = replay(plan, trace, **kw)
    host, disk = rt.counter.decode_bytes_per_token(), rt.disk_counter.decode_bytes_per_token()
    out.update(measured_link_bytes_per_token=host, measured_disk_bytes_per_token=disk,
               replay=want.to_dict(), trace_decode_tokens=want.tokens)
    checks.check(f"{label}: measured host link bytes/token == replay of the same trace",
                 _close(host, want.host_link_bytes_per_token) and want.tokens == args.trace_tokens,
                 f"measured {host:.1f} B, replay {want.host_link_bytes_per_token:.1f} B over {want.tokens} decode tokens")
    if plan.disk_bytes:
        checks.check(f"{label}: measured disk bytes/token == replay of the same trace",
                     _close(disk, want.disk_read_bytes_per_token) and disk > 0,
                     f"measured {disk:.1f} B, replay {want.disk_read_bytes_per_token:.1f} B")
    checks.check(f"{label}: the generation read offloaded bytes (> 0)", host + disk > 0,
                 f"{(host + disk) / MIB:.3f} MiB/token")
    if rt.cache is not None:
        s = rt.cache.stats()
        out["cache"] = s
        checks.check(f"{label}: cache hits and misses == replay's", (s["cache_hits"], s["cache_misses"]) ==
                     (want.cache_hits, want.cache_misses),
                     f"runtime {s['cache_hits']}/{s['cache_misses']}, replay {want.cache_hits}/{want.cache_misses} "
                     "(hits/misses)")
        checks.check(f"{label}: cache hits > 0", s["cache_hits"] > 0,
                     f"{s['cache_hits']} hits, {s['cache_misses']} misses, {s['cache_evictions']} evictions")
        checks.check(f"{label}: cache pages within its capacity", 0 < s["cache_device_bytes"] <= s["cache_bytes"],
                     f"carved {s['cache_device_bytes']} B of {s['cache_bytes']} B")


def run_case(case: dict, folder: Path, ids, args, dev, checks: Checks, slack: int, tmp: Path) -> dict:
    """Load one configuration, check placement, memory, link bytes vs replay; record tokens and tok/s."""
    import torch

    import moe_offload

    label = case["label"]
    gc.collect()
    _sync(dev)
    before = _allocated(dev)
    t0 = time.perf_counter()
    model, plan = moe_offload.load(folder, device=str(dev), backend=case["backend"], **case["load"])
    _sync(dev)
    load_s = time.perf_counter() - t0
    rt = model.moe_offload_runtime
    try:
        out = {"label": label, "case": case["case"], "model": case["model"], "kind": case["kind"], "backend": case["backend"],
               "policy": plan.policy, "load_s": load_s, "mechanism": rt.mechanism,
               "arena_mechanism": rt.arena.mechanism, "resident_bytes": plan.resident_bytes,
               "offloaded_bytes": plan.offloaded_bytes, "host_bytes": plan.host_bytes, "disk_bytes": plan.disk_bytes,
               "host_arena_bytes": rt.host_bytes, "split_tensors": len(rt.splits),
               "cache_device_bytes": rt.cache.device_bytes if rt.cache is not None else 0,
               "planned_link_bytes_per_token": plan.link_bytes_per_token(),
               "measured_link_bytes_per_token": 0.0, "measured_disk_bytes_per_token": 0.0}
        for check in case.get("plan_checks", ()):
            check(label, plan, rt, checks)
        audit = moe_offload.audit(model, plan)
        checks.check(f"{label}: audit empty", not audit, f"{len(audit)} mismatches, first {audit[:2]}" if audit else "")
        _placement(label, case, model, plan, rt, dev, checks)
        out["device_bytes_after_load"] = _memory(label, "after load", model, plan, rt, dev, before, slack, checks)

        if plan.offloaded_bytes:
            _link_vs_replay(label, model, plan, rt, folder, tmp, args, checks, out)

        # Greedy tokens for the comparison with the resident run, and first-step logits for a diagnosis.
        with torch.no_grad():
            out["prefill_logits"] = model(ids).logits[0, -1].float().cpu()
        out["tokens"] = _generate(model, ids, args.check_tokens)[0, ids.shape[1]:].tolist()
        if rt.lookahead is not None:   # its tokens are compared with the resident run's like every load's
            out["lookahead"] = rt.lookahead.stats(args.check_tokens - 1)
            checks.check(f"{label}: picked experts were taken from rows copied ahead (look-ahead hits > 0)",
                         rt.lookahead.hits > 0, f"{rt.lookahead.hits} hits, {rt.lookahead.misses} misses")
        audit = moe_offload.audit(model, plan)
        checks.check(f"{label}: audit empty after generate", not audit, f"first {audit[:2]}" if audit else "")
        out["device_bytes_after_generate"] = _memory(label, "after generate", model, plan, rt, dev, before, slack,
                                                     checks)

        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        out["tok_s"], out["decode_s"] = _tok_s(model, ids, args.bench_tokens, args.runs, dev)
        out["peak_device_bytes_decode"] = torch.cuda.max_memory_allocated(dev) - before if dev.type == "cuda" else None
        if rt.cache is not None:
            out["cache_after_bench"] = rt.cache.stats()
    finally:
        # Unregister before the slabs can be freed (cudaErrorHostMemoryAlreadyRegistered otherwise).
        release_uninterrupted(model)
    return out
