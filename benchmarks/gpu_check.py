"""One short check of every CUDA path (slabs, UVA, prefetch, splits, cache, quantized, disk), for a GPU machine.

    .venv/bin/python benchmarks/gpu_check.py            # exit 0: all PASS, 1: a FAIL; JSON to $OUT or bench-out

On a lent device machine (its image has torch with CUDA, transformers, rich, safetensors):
    run(command="PYTHONUNBUFFERED=1 PYTHONPATH=src python3 benchmarks/gpu_check.py 2>&1 | tee $OUT/log",
        timeout_s=540)      # --time-limit 420 s by default; the watchdog ends it by 450 s

Without a CUDA device it prints "no CUDA device: nothing to check" and exits 0. `--allow-cpu` runs
the same steps on the CPU (smaller model and fewer tokens unless given), skipping the CUDA-only
checks: a dry run of the script itself (a minute or two on 2 cores).

Models, made with make_tiny in a temporary folder (default hidden 512, 8 layers, 32 experts, top-2):
qwen3_moe bf16; qwen3_moe FP8 (block-scaled); gpt_oss MXFP4. Loads, at half the model's bytes offloaded:
- bf16: all resident; sparse-first and declaration order with uva and prefetch; a frequency plan from a
  profiled trace (`moe_offload.measure.profile.profile`, `policy="frequency"`, `stats=traces.expert_counts`), whose
  fused expert tensors are split by any subset of experts (uva gathers host rows through the device view,
  prefetch copies rows one by one); the device-side expert cache (`cache_gb`, heat on uva, lru on prefetch);
  the disk tier (the sparse-first plan with the offloaded tensors of even layers and the embedding moved to
  disk, whole or as expert subsets; and the planner's own `host_memory_gb` placement, a quarter of the model
  in host memory, which SKIPs, naming why, while the loader refuses a tensor split across three tiers);
- FP8 and MXFP4: all resident; sparse-first with uva and prefetch (dequantized on the device after the
  gather; FP8 Linear weights per call); FP8 with a cache too.
Checks (a PASS or FAIL line each; SKIP where a path is missing or needs CUDA):
- the audit is empty after load and after generate;
- placement: offloaded params lie in registered, pinned slabs (uva: CUDA views aliasing the host address;
  prefetch: host tensors); the arena holds the plan's host bytes within 1%; disk-tier params hold no memory;
- device memory: torch.cuda.memory_allocated() grows, after load and after generate, by at most what the
  plan keeps resident + the cache's carved pages + the runtime's staging buffers + a small slack;
- link bytes: a generation recorded as a trace (`profile.record`) reads, by the runtime's counters, exactly
  what `replay` of that trace says (host and disk apart; with a cache, the same hits and misses; hits > 0);
- greedy tokens (32 new) equal the all-resident run of the same checkpoint (bf16: bit for bit on the GPU;
  quantized: their own all-resident quantized run).
Then tok/s (median of 3 after a warm-up, 64 new tokens) of every load: a table (uva / prefetch / frequency /
cache / disk / quantized), also written to gpu_check_tok_s.json. Each step runs under its own time limit
(--case-limit; a step past it FAILs and the script goes on), the whole under --time-limit, and a hard
watchdog (faulthandler) ends the process if a hang in native code keeps Python from noticing; the JSON is
rewritten after every step, so even then what ran is on disk.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import json
import math
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

GIB = 2 ** 30
MIB = 2 ** 20
ROOT = Path(__file__).resolve().parent.parent
# Sizes of a real check (GPU) and of the CPU dry run; an option given on the command line wins over both.
GPU_SIZES = dict(hidden=512, layers=8, experts=32, check_tokens=32, bench_tokens=64, runs=3, trace_tokens=16)
CPU_SIZES = dict(hidden=64, layers=2, experts=16, check_tokens=6, bench_tokens=4, runs=1, trace_tokens=4)


class StepTimeout(BaseException):
    """One step ran past its limit. A BaseException: library code's `except Exception` must not swallow it."""


class RunTimeout(BaseException):
    """The whole run reached --time-limit."""


class Guard:
    """Time limits: per step (SIGALRM, soft: raised in Python) under one deadline for the run, and a
    faulthandler watchdog a little after the deadline for hangs inside native code (a stuck kernel)."""

    def __init__(self, total_s: float, grace_s: float = 30):
        self.deadline = time.monotonic() + total_s
        self.total_s = total_s
        self.step = ""
        signal.signal(signal.SIGALRM, self._fire)
        faulthandler.dump_traceback_later(total_s + grace_s, exit=True)

    def _fire(self, signum, frame):
        if time.monotonic() >= self.deadline - 0.01:
            raise RunTimeout(f"gpu_check ran past --time-limit {self.total_s:.0f} s (in step {self.step!r})")
        raise StepTimeout(f"step {self.step!r} ran past its limit")

    @contextlib.contextmanager
    def limit(self, step: str, seconds: float):
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RunTimeout(f"gpu_check ran past --time-limit {self.total_s:.0f} s (before step {step!r})")
        self.step = step
        signal.setitimer(signal.ITIMER_REAL, min(seconds, left))
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)

    def close(self) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        faulthandler.cancel_dump_traceback_later()


class Checks:
    def __init__(self):
        self.rows: list[dict] = []

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.rows.append({"check": name, "result": "PASS" if ok else "FAIL", "detail": detail})
        print(f"{'PASS' if ok else 'FAIL'}  {name}" + (f"  ({detail})" if detail else ""), flush=True)
        return ok

    def skip(self, name: str, why: str) -> None:
        self.rows.append({"check": name, "result": "SKIP", "detail": why})
        print(f"SKIP  {name}  ({why})", flush=True)

    @property
    def failed(self) -> list[dict]:
        return [r for r in self.rows if r["result"] == "FAIL"]


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
    dense tensors, dequantized weights. (The same buffers bench.device_resident_bytes adds.)"""
    bufs = list(getattr(rt, "_staging", {}).values())
    bufs += list(getattr(getattr(rt, "_dense", None), "ring", []))
    if rt.dequantizer is not None:
        bufs += rt.dequantizer.buffers()
    return _nbytes(b for b in bufs if b.device.type == rt.device.type)


def _first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


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
    from moe_offload.planning.planner import GiB
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
        # Unregister before the slabs can be freed: a freed-but-registered range makes a later
        # cudaHostRegister of reused addresses fail (cudaErrorHostMemoryAlreadyRegistered). A step timeout
        # must not cut this short: SIGALRM waits (blocked) until the release is done.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        try:
            _release(model)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})
    return out


# --- plan checks: that a case exercises the path it is named for ---------------------------------------------

def _splits_any_subset(label, plan, rt, checks: Checks) -> None:
    split = [t for t in plan.tensors if t.tier != "device" and t.host_ids and len(t.host_ids) < t.shape[0]]
    not_suffix = [t for t in split if t.host_ids != tuple(range(t.shape[0] - len(t.host_ids), t.shape[0]))]
    checks.check(f"{label}: the plan splits fused expert tensors by a non-suffix subset of experts",
                 bool(not_suffix) and len(rt.splits) == len(split),
                 f"{len(split)} split tensors ({len(not_suffix)} not a suffix), runtime holds {len(rt.splits)}; "
                 f"e.g. {not_suffix[0].name} host experts {list(not_suffix[0].host_ids)[:8]}" if not_suffix else
                 f"{len(split)} split tensors, none by a non-suffix subset")


def _has_disk(label, plan, rt, checks: Checks) -> None:
    checks.check(f"{label}: the plan puts bytes on disk and the runtime reads them through its disk tier",
                 plan.disk_bytes > 0 and rt.disk is not None,
                 f"disk {plan.disk_bytes / MIB:.1f} MiB, host {plan.host_bytes / MIB:.1f} MiB; "
                 f"{rt.disk.mechanism if rt.disk is not None else 'no disk tier'}")


def _is_quantized(label, plan, rt, checks: Checks) -> None:
    checks.check(f"{label}: the runtime holds quantized tensors and dequantizes on the device",
                 bool(rt.quant) and rt.dequantizer is not None, f"{len(rt.quant)} quantized tensors")


# --- the models and their loads ----------------------------------------------------------------------------

def _bf16_cases(folder: Path, half_gb: float, total: int, tmp: Path, args, dev, guard: Guard, checks: Checks):
    """The bf16 loads; the frequency plan's trace is profiled here (a resident load of its own)."""
    import moe_offload
    from moe_offload.formats import traces
    from moe_offload.measure.profile import profile
    from moe_offload.prompts import PROMPTS

    half = dict(offload_gb=half_gb)
    cases = [dict(label="resident", kind="resident", backend="uva", load=dict(offload_gb=0))]
    for policy in ("sparse-first", "declaration"):
        for backend in ("uva", "prefetch"):
            cases.append(dict(label=f"{policy}/{backend}", kind=backend, backend=backend,
                              load=dict(policy=policy, **half)))
    freq_plan = None
    try:
        with guard.limit("profile for the frequency plan", args.case_limit):
            result = profile(folder, tmp / "profile.jsonl", prompts=PROMPTS[:4], max_new_tokens=args.trace_tokens,
                             device=str(dev), ignore_eos=True)
            stats = traces.expert_counts([traces.read_trace(result.out)])
            freq_plan = moe_offload.plan(folder, policy="frequency", stats=stats, **half)
        checks.check("profile -> frequency plan", True, f"{result.to_dict()['decode_tokens']} decode tokens profiled")
    except StepTimeout as exc:
        checks.check("profile -> frequency plan", False, str(exc))
    except Exception as exc:
        traceback.print_exc()
        checks.check("profile -> frequency plan", False, f"{type(exc).__name__}: {exc}")
    if freq_plan is not None:
        for backend in ("uva", "prefetch"):
            cases.append(dict(label=f"frequency/{backend}", kind=f"frequency-{backend}", backend=backend,
                              load=dict(plan=freq_plan), plan_checks=(_splits_any_subset,)))
    cache_gb = half_gb / 4   # a quarter of the offloaded bytes: hits and evictions both
    for backend, policy in (("uva", "heat"), ("prefetch", "lru")):
        cases.append(dict(label=f"cache-{policy}/{backend}", kind=f"cache-{backend}", backend=backend,
                          load=dict(cache_gb=cache_gb, cache_policy=policy, **half)))
    on_disk = disk_plan(moe_offload.plan(folder, **half))
    for backend in ("uva", "prefetch"):
        cases.append(dict(label=f"disk/{backend}", kind=f"disk-{backend}", backend=backend, load=dict(plan=on_disk),
                          plan_checks=(_has_disk,)))
    # The planner's own disk placement (host_memory_gb: a quarter of the model in host memory), where the
    # loader can hold it: a tensor split across device, host and disk is refused by it (not loadable yet).
    planned = moe_offload.plan(folder, host_memory_gb=total / 4 / GIB, **half)
    three = [t.name for t in planned.tensors if t.tier == "disk" and t.disk_ids and t.memory_ids]
    if three:
        checks.skip("bf16 disk-planned (host_memory_gb)", f"the planner splits {three[0]} across device, host and "
                    "disk; the loader cannot load such a tensor yet (disk_tier.DiskTier.build refuses it)")
    elif not planned.disk_bytes:
        checks.check("bf16 disk-planned (host_memory_gb): the planner puts bytes on disk", False,
                     f"host_memory_gb {total / 4 / MIB:.1f} MiB of a {total / MIB:.1f} MiB model: disk 0 B")
    else:
        cases.append(dict(label="disk-planned/prefetch", kind="disk-prefetch", backend="prefetch",
                          load=dict(plan=planned), plan_checks=(_has_disk,)))
    return cases


def disk_plan(plan):
    """`plan` with the offloaded tensors of even layers and the embedding on the disk tier (a split tensor: all its
    offloaded experts), odd layers' in host memory: both tiers, whole tensors and expert subsets on disk."""
    import dataclasses

    def move(t):
        if t.tier == "host" and ((t.layer is not None and t.layer % 2 == 0) or t.role == "embedding"):
            return dataclasses.replace(t, tier="disk")
        return t

    return dataclasses.replace(plan, tensors=tuple(move(t) for t in plan.tensors))


def _quant_cases(half_gb: float, cache: bool):
    cases = [dict(label="resident", kind="resident", backend="uva", load=dict(offload_gb=0),
                  plan_checks=(_is_quantized,))]
    for backend in ("uva", "prefetch"):
        cases.append(dict(label=f"sparse-first/{backend}", kind=f"quantized-{backend}", backend=backend,
                          load=dict(offload_gb=half_gb), plan_checks=(_is_quantized,)))
    if cache:
        cases.append(dict(label="cache-heat/uva", kind="quantized-cache-uva", backend="uva",
                          load=dict(offload_gb=half_gb, cache_gb=half_gb / 4), plan_checks=(_is_quantized,)))
    return cases


def _compare_tokens(model_key: str, cases: list[dict], check_tokens: int, checks: Checks) -> None:
    mine = [c for c in cases if c["model"] == model_key]
    ref = next((c for c in mine if c["kind"] == "resident"), None)
    if ref is None:
        checks.check(f"{model_key}: all-resident reference run", False, "it failed: no tokens to compare with")
        return
    for c in mine:
        if c is ref:
            continue
        same = c["tokens"] == ref["tokens"]
        diff = (c["prefill_logits"] - ref["prefill_logits"]).abs().max().item()
        first = _first_diff(c["tokens"], ref["tokens"])
        checks.check(f"greedy tokens equal: {model_key} resident vs {c['label']} ({check_tokens} new)", same,
                     f"max |prefill logit diff| {diff:.3g}" + ("" if same else f"; first differs at {first}"))


def machine(dev) -> dict:
    import torch
    import transformers

    info = {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "transformers": transformers.__version__, "device": str(dev)}
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        info.update(gpu=p.name, gpu_memory_bytes=p.total_memory, cuda=torch.version.cuda,
                    capability=f"{p.major}.{p.minor}")
    return info


def tok_s_table(cases: list[dict]) -> list[dict]:
    return [{"model": c["model"], "load": c["case"], "kind": c["kind"], "backend": c["backend"],
             "tok_s": c["tok_s"], "offloaded_bytes": c["offloaded_bytes"], "disk_bytes": c["disk_bytes"],
             "measured_link_bytes_per_token": c["measured_link_bytes_per_token"] + c["measured_disk_bytes_per_token"],
             "planned_link_bytes_per_token": c["planned_link_bytes_per_token"],
             "cache_hit_rate": (c["cache"]["cache_hits"] / max(1, c["cache"]["cache_hits"] + c["cache"]["cache_misses"])
                                if "cache" in c else None)}
            for c in cases]


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="gpu_check: tok/s at the same offload budget (half the model)")
    cols = ("model", "load", "kind", "offloaded MiB", "disk MiB", "planned link MiB/tok", "measured link MiB/tok",
            "cache hit rate", "tok/s")
    for col in cols:
        t.add_column(col, justify="left" if col in ("model", "load", "kind") else "right")
    for r in rows:
        hit = "" if r["cache_hit_rate"] is None else f"{r['cache_hit_rate']:.2f}"
        t.add_row(r["model"], r["load"], r["kind"], f"{r['offloaded_bytes'] / MIB:.1f}", f"{r['disk_bytes'] / MIB:.1f}",
                  f"{r['planned_link_bytes_per_token'] / MIB:.3f}", f"{r['measured_link_bytes_per_token'] / MIB:.3f}",
                  hit, f"{r['tok_s']:.2f}")
    (Console() if sys.stdout.isatty() else Console(width=170)).print(t)


def _options(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--experts", type=int)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--check-tokens", type=int)
    p.add_argument("--bench-tokens", type=int)
    p.add_argument("--trace-tokens", type=int, help="decode tokens of each recorded trace (link bytes vs replay)")
    p.add_argument("--runs", type=int)
    p.add_argument("--time-limit", type=int, default=420, help="stop (FAIL) after this many seconds in all")
    p.add_argument("--case-limit", type=int, default=90, help="FAIL a step (one load, its checks and decode) "
                                                                "past this many seconds and go on")
    p.add_argument("--only", choices=("bf16", "fp8", "mxfp4"), action="append", help="models to check (default all)")
    p.add_argument("--allow-cpu", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _options(argv)

    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        print("no CUDA device: nothing to check (gpu_check needs torch.cuda; this torch is "
              f"{torch.__version__}, cuda {torch.version.cuda})")
        return 0
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    for k, v in (GPU_SIZES if dev.type == "cuda" else CPU_SIZES).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    models = args.only or ["bf16", "fp8", "mxfp4"]

    guard = Guard(args.time_limit)
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "bench-out"
    out_dir.mkdir(parents=True, exist_ok=True)
    checks, cases, report = Checks(), [], {"machine": machine(dev), "options": vars(args), "models": {}}
    t_start = time.perf_counter()

    def write(final: bool = False) -> Path:
        """The report as it stands (after every step: a hard stop still leaves what ran)."""
        rows = [c for c in cases if "tok_s" in c]
        report.update(cases=[{k: v for k, v in c.items() if k != "prefill_logits"} for c in cases],
                      checks=checks.rows, wall_s=time.perf_counter() - t_start, finished=final,
                      passed=final and not checks.failed, tok_s=tok_s_table(rows))
        (out_dir / "gpu_check_tok_s.json").write_text(json.dumps(report["tok_s"], indent=2) + "\n")
        path = out_dir / "gpu_check.json"
        path.write_text(json.dumps(report, indent=2) + "\n")
        return path

    print(f"gpu_check on {report['machine'].get('gpu', dev)} (torch {torch.__version__}, cuda {torch.version.cuda})",
          flush=True)
    try:
        from transformers import AutoTokenizer

        import moe_offload
        from moe_offload.prompts import PROMPTS
        from moe_offload.tiny.make import make_tiny

        specs = {"bf16": dict(family="qwen3_moe", dtype="bfloat16", quant=None),
                 "fp8": dict(family="qwen3_moe", dtype="bfloat16", quant="fp8"),
                 "mxfp4": dict(family="gpt_oss", dtype="bfloat16", quant="mxfp4")}
        with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp_s:
            tmp = Path(tmp_s)
            for key in models:
                spec = specs[key]
                try:
                    with guard.limit(f"make {key} model", args.case_limit):
                        t0 = time.perf_counter()
                        folder = make_tiny(tmp / key, hidden=args.hidden, layers=args.layers, experts=args.experts,
                                           top_k=args.top_k, **spec)
                        total = moe_offload.plan(folder, offload_gb=0).total_bytes
                except (StepTimeout, Exception) as exc:
                    traceback.print_exc()
                    checks.check(f"{key}: make_tiny {spec['family']} quant={spec['quant']}", False,
                                 f"{type(exc).__name__}: {exc}")
                    continue
                half_gb = total / 2 / GIB
                report["models"][key] = dict(spec, hidden=args.hidden, layers=args.layers, experts=args.experts,
                                             top_k=args.top_k, total_bytes=total, offload_gb=half_gb,
                                             make_s=time.perf_counter() - t0)
                print(f"model {key} ({spec['family']}, quant {spec['quant']}): {total / MIB:.1f} MiB, offload budget "
                      f"{half_gb * 1024:.1f} MiB (made in {report['models'][key]['make_s']:.0f} s)", flush=True)
                ids = AutoTokenizer.from_pretrained(folder)(PROMPTS[0], return_tensors="pt").input_ids.to(dev)
                slack = 32 * MIB
                if key == "bf16":
                    todo = _bf16_cases(folder, half_gb, total, tmp, args, dev, guard, checks)
                else:
                    todo = _quant_cases(half_gb, cache=key == "fp8")
                for case in todo:
                    case["model"], case["case"] = key, case["label"]
                    label = case["label"] = f"{key} {case['label']}"
                    try:
                        with guard.limit(label, args.case_limit):
                            cases.append(run_case(case, folder, ids, args, dev, checks, slack, tmp))
                    except StepTimeout as exc:
                        checks.check(f"{label}: within --case-limit {args.case_limit} s", False, str(exc))
                    except Exception as exc:  # record and go on: one run of this script should say as much as it can
                        traceback.print_exc()
                        checks.check(f"{label}: load, check and decode without error", False,
                                     f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
                    gc.collect()
                    write()
                _compare_tokens(key, cases, args.check_tokens, checks)
                for c in cases:
                    if c["model"] == key:
                        c.pop("prefill_logits", None)
                write()
        print_table(tok_s_table(cases))
    except RunTimeout as exc:
        checks.check("gpu_check within --time-limit", False, str(exc))
    except Exception as exc:
        traceback.print_exc()
        checks.check("gpu_check ran to the end", False, f"{type(exc).__name__}: {exc}")
    finally:
        guard.close()
        path = write(final=True)
        print(f"wrote {path} and gpu_check_tok_s.json ({report['wall_s']:.0f} s); "
              f"{sum(r['result'] == 'PASS' for r in checks.rows)} PASS, {len(checks.failed)} FAIL, "
              f"{sum(r['result'] == 'SKIP' for r in checks.rows)} SKIP", flush=True)
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
