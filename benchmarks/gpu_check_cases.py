"""The loads benchmarks/gpu_check.py makes of each model (bf16: resident, sparse-first and declaration order,
a profiled frequency plan, the cache, the disk tier; FP8 and MXFP4: resident, sparse-first, FP8 with a cache),
the plan checks that each exercises the path it is named for, and the comparison of their greedy tokens with
the all-resident run."""

from __future__ import annotations

import traceback
from pathlib import Path

from gpu_check_harness import GIB, MIB, Checks, Guard, StepTimeout


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


def _looks_ahead(label, plan, rt, checks: Checks) -> None:
    # CPU (the dry run): no side stream, the copies go to a worker thread
    checks.check(f"{label}: the runtime looks ahead and copies host-tier experts on its side stream",
                 rt.lookahead is not None and (rt.stream is not None or rt.device.type == "cpu"),
                 f"lookahead {getattr(rt.lookahead, 'distance', None)}, side stream {rt.stream}")


def _is_quantized(label, plan, rt, checks: Checks) -> None:
    checks.check(f"{label}: the runtime holds quantized tensors and dequantizes on the device",
                 bool(rt.quant) and rt.dequantizer is not None, f"{len(rt.quant)} quantized tensors")


# --- the models and their loads ----------------------------------------------------------------------------

def bf16_cases(folder: Path, half_gb: float, total: int, tmp: Path, args, dev, guard: Guard, checks: Checks):
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
    # Look-ahead (issue 18): predicted host-tier experts copied to the device on the side stream before their
    # router asks; the tokens, link bytes and cache counts must be those without it.
    for backend in ("uva", "prefetch"):
        cases.append(dict(label=f"lookahead/{backend}", kind=f"lookahead-{backend}", backend=backend,
                          load=dict(lookahead=1, **half), plan_checks=(_looks_ahead,)))
    cases.append(dict(label="lookahead-cache-lru/prefetch", kind="lookahead-cache-prefetch", backend="prefetch",
                      load=dict(lookahead=1, cache_gb=cache_gb, cache_policy="lru", **half),
                      plan_checks=(_looks_ahead,)))
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


def quant_cases(half_gb: float, cache: bool):
    cases = [dict(label="resident", kind="resident", backend="uva", load=dict(offload_gb=0),
                  plan_checks=(_is_quantized,))]
    for backend in ("uva", "prefetch"):
        cases.append(dict(label=f"sparse-first/{backend}", kind=f"quantized-{backend}", backend=backend,
                          load=dict(offload_gb=half_gb), plan_checks=(_is_quantized,)))
    if cache:
        cases.append(dict(label="cache-heat/uva", kind="quantized-cache-uva", backend="uva",
                          load=dict(offload_gb=half_gb, cache_gb=half_gb / 4), plan_checks=(_is_quantized,)))
    return cases

def _first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def compare_tokens(model_key: str, cases: list[dict], check_tokens: int, checks: Checks) -> None:
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
