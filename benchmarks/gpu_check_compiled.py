"""The grouped experts and the compiled decode step (issue 17) in benchmarks/gpu_check.py.

Per model (qwen3_moe bf16 and gpt_oss bf16, made with make_tiny at the check's sizes), loads of one checkpoint:
- experts="grouped": resident (the reference); half the model offloaded (sparse-first: a split expert tensor
  and the embedding on the host) with uva and with prefetch; every routed-expert tensor whole on the host under
  uva (`offload_params="experts"`: no split, no gather, so the uva reads stay inside the compiled graph);
- experts="eager" of resident, uva-whole and prefetch: the decode tok/s the grouped kernels are weighed against.
Checks (PASS / FAIL rows; SKIP, naming why, where compiling is impossible here, and for gpt_oss's compiled
loads on the CPU dry run, which compiles qwen3's only):
- every grouped load with something offloaded: the logits of every generated step (prefill and decode) bitwise
  equal the grouped resident run's, and its link bytes per token equal `replay` of its own recorded trace
  (gpu_check_load._link_vs_replay, as the other sections); uva-whole: the plan holds only whole expert tensors;
- resident, uva-whole and prefetch compiled (`model.generate(**compile_kwargs(model))`; on CUDA
  mode="reduce-overhead", CUDA graphs): the tokens equal the same load's uncompiled grouped run up to the first
  step whose uncompiled top-1/top-2 logit margin is <= MARGIN (a near tie, where other arithmetic may pick
  the other token; nothing after it is compared); the decode steps before any token differs read the same
  link bytes as the uncompiled ones; dynamo never hit its recompile limit (past it, frames run eagerly, silently);
- each eager load vs the grouped resident run: tokens equal under the same margin rule (other arithmetic).
Reported (gpu_check.json "grouped", and a table): decode tok/s (1 / median step time) eager / grouped /
compiled, compile_s (the first compiled step beyond a warm one), link bytes per token, and the per-step time
against the link floor, bytes per token / the measured pinned host->device copy bandwidth (CUDA only).
Alone: `gpu_check.py --only grouped` (it runs last in a full check). Every load starts from torch._dynamo.reset(),
so its compile_s and its recompile-limit count are its own.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
import traceback
from pathlib import Path

from gpu_check_harness import GIB, MIB, Checks, Guard, StepTimeout
from gpu_check_load import _link_vs_replay, _sync, release_uninterrupted

MARGIN = 1e-3          # logits margin below which a differing token is a tie, not a failure
MODELS = {"qwen3": "qwen3_moe", "gpt_oss": "gpt_oss"}
# The CPU dry run compiles one model's loads only: inductor's C++ builds take 10-40 s a load on 2 cores.
CPU_COMPILED = {"qwen3"}


# --- measuring --------------------------------------------------------------------------------------------

def h2d_bandwidth(dev, nbytes: int = 128 * MIB, reps: int = 5) -> float | None:
    """Best pinned host -> device copy rate (bytes/s) on CUDA, else None."""
    import torch

    if dev.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst.copy_(src, non_blocking=True)
    _sync(dev)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        _sync(dev)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


class _Fallbacks(logging.Handler):
    """Collects dynamo's "hit config.recompile_limit" warnings: past the limit a frame runs eagerly, silently."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.hits: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        if "recompile_limit" in msg or "cache_size_limit" in msg:
            self.hits.append(" ".join(msg.split())[:240])


@contextlib.contextmanager
def _watch_fallbacks():
    logger = logging.getLogger("torch._dynamo.convert_frame")
    handler = _Fallbacks()
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def _reference(model, enc, n: int):
    """Greedy tokens, each step's logits (float32, cpu) and top-1/top-2 margins of an uncompiled run."""
    import torch

    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    logits = torch.stack([s[0] for s in out.logits]).float().cpu()        # [n, V]
    top = logits.topk(2, dim=-1).values
    return out.sequences[0, enc["input_ids"].shape[1]:].tolist(), logits, (top[:, 0] - top[:, 1]).tolist()


def _decode(model, enc, n: int, runs: int, dev, **generate_kwargs) -> dict:
    """A first run (it compiles, when asked to) and `runs` timed ones, every one of n new tokens (one static
    cache size: a second size would compile again)."""
    from moe_offload.measure.timing import greedy_generate
    from moe_offload.run.compiled import compile_seconds

    t0 = time.perf_counter()
    first = greedy_generate(model, enc, n, dev, **generate_kwargs)
    first_s = time.perf_counter() - t0
    later = [greedy_generate(model, enc, n, dev, **generate_kwargs) for _ in range(runs)]
    step_s = statistics.median(s for r in later for s in r.itl_s)
    return {"tokens": first.token_ids[0].tolist(), "step_link_bytes": first.decode_link_bytes,
            "first_run_s": first_s, "compile_s": compile_seconds(first.itl_s), "step_s": step_s,
            "tok_s": 1 / step_s, "same_tokens_every_run": all(r.token_ids.equal(first.token_ids) for r in later)}


def _first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def margin_rule(name: str, got: list[int], want: list[int], margins: list[float], checks: Checks) -> int | None:
    """Tokens equal `want` up to its first near tie (margin <= MARGIN); returns the first differing step."""
    first = _first_diff(got, want)
    if first is None:
        checks.check(name, len(got) == len(want), f"{len(want)} tokens equal; smallest margin {min(margins):.3g}")
    else:
        checks.check(name, margins[first] <= MARGIN,
                     f"first differs at step {first} of {len(want)}, where the uncompiled margin is "
                     f"{margins[first]:.3g} ({'<=' if margins[first] <= MARGIN else '>'} {MARGIN:g}: "
                     f"{'a near tie, nothing after it compared' if margins[first] <= MARGIN else 'not a tie'})")
    return first


# --- one load ----------------------------------------------------------------------------------------------

def _whole_experts(label, plan, rt, checks: Checks) -> None:
    off = [t for t in plan.tensors if t.tier != "device"]
    bad = [t.name for t in off if t.role != "routed_expert" or t.is_split or t.tier != "host"]
    checks.check(f"{label}: the plan offloads whole routed-expert tensors only (uva reads them in place)",
                 bool(off) and not bad and not rt.splits,
                 f"{len(off)} tensors on the host, {plan.host_bytes / MIB:.2f} MiB; not whole experts: {bad[:3]}")


def run_load(case: dict, folder: Path, enc, args, dev, checks: Checks, tmp: Path, ref: dict | None) -> dict:
    """Load, check the plan and the audit, link bytes vs replay, logits vs `ref` (bitwise); uncompiled decode;
    then, when asked, the compiled decode: tokens by the margin rule, link bytes per step, fallbacks."""
    import torch

    import moe_offload
    from moe_offload.errors import MoeOffloadError
    from moe_offload.run.compiled import compile_kwargs

    label, n, t0 = case["label"], args.check_tokens, time.perf_counter()
    torch._dynamo.reset()   # each load compiles its own graphs: none left over from another counts to its limits
    with _watch_fallbacks() as fallbacks:
        model, plan = moe_offload.load(folder, device=str(dev), backend=case["backend"], experts=case["experts"],
                                       **case["load"])
        rt = model.moe_offload_runtime
        out = {"label": label, "experts": case["experts"], "backend": case["backend"], "mechanism": rt.mechanism,
               "offloaded_bytes": plan.offloaded_bytes, "planned_link_bytes_per_token": plan.link_bytes_per_token()}
        try:
            for check in case.get("plan_checks", ()):
                check(label, plan, rt, checks)
            audit = moe_offload.audit(model, plan)
            checks.check(f"{label}: audit empty", not audit, f"first {audit[:2]}" if audit else "")
            if plan.offloaded_bytes and case["experts"] == "grouped":
                _link_vs_replay(label, model, plan, rt, folder, tmp, args, checks, out)
            out["tokens"], logits, out["margins"] = _reference(model, enc, n)
            if ref is not None and case["experts"] == "grouped":
                same = logits.shape == ref["logits"].shape and torch.equal(logits, ref["logits"])
                diff = ((logits - ref["logits"]).abs().max().item() if logits.shape == ref["logits"].shape
                        else float("nan"))
                first = _first_diff(out["tokens"], ref["tokens"])
                checks.check(f"{label} vs grouped resident: logits of all {n} steps bitwise equal", same,
                             f"max |diff| {diff:.3g}; first token differs at {first}")
            elif ref is not None:
                margin_rule(f"{label} vs grouped resident: tokens equal (margin rule)", out["tokens"], ref["tokens"],
                            ref["margins"], checks)
            out["uncompiled"] = _decode(model, enc, n, args.runs, dev)
            out["link_bytes_per_token"] = rt.counter.decode_bytes_per_token() + rt.disk_counter.decode_bytes_per_token()
            if case.get("compile") and case.get("compile_skip"):
                checks.skip(f"{label}: compiled decode", case["compile_skip"])
            elif case.get("compile"):
                try:
                    kwargs = compile_kwargs(model)
                except MoeOffloadError as exc:
                    checks.skip(f"{label}: compiled decode", str(exc).splitlines()[0])
                else:
                    _compiled(label, model, enc, n, args, dev, kwargs, checks, out)
            audit = moe_offload.audit(model, plan)
            checks.check(f"{label}: audit empty after the runs", not audit, f"first {audit[:2]}" if audit else "")
        finally:
            release_uninterrupted(model)   # as gpu_check_load.run_case
    if case["experts"] == "grouped":   # the grouped kernels and the compiled step are what dynamo compiles
        checks.check(f"{label}: dynamo never hit its recompile limit (no frame fell back to eager)",
                     not fallbacks.hits, f"{len(fallbacks.hits)} hits, first: {fallbacks.hits[0]}" if fallbacks.hits
                     else "")
    out["logits"], out["wall_s"] = logits, time.perf_counter() - t0
    return out


def _compiled(label, model, enc, n, args, dev, kwargs, checks: Checks, out: dict) -> None:
    mode = kwargs["compile_config"].mode
    run = out["compiled"] = _decode(model, enc, n, args.runs, dev, **kwargs)
    run["mode"] = mode
    checks.check(f"{label} compiled ({mode}): same tokens every run", run["same_tokens_every_run"])
    first = margin_rule(f"{label} compiled ({mode}) vs uncompiled: tokens equal (margin rule)", run["tokens"],
                        out["tokens"], out["margins"], checks)
    ref_steps = out["uncompiled"]["step_link_bytes"]
    k = len(ref_steps) if first is None else min(first, len(ref_steps))
    checks.check(f"{label} compiled: link bytes of each decode step == uncompiled's ({k} steps before any token "
                 "differs)", run["step_link_bytes"][:k] == ref_steps[:k],
                 f"compiled {run['step_link_bytes'][:4]}..., uncompiled {ref_steps[:4]}...")


# --- the section ----------------------------------------------------------------------------------------

def _cases(folder: Path, half_gb: float):
    import moe_offload

    resident = moe_offload.plan(folder, offload_gb=0)
    experts_gb = sum(t.bytes for t in resident.tensors if t.role == "routed_expert") / GIB   # exact: a power of 2
    whole = dict(offload_params="experts", offload_gb=experts_gb)
    half = dict(offload_gb=half_gb)
    return [dict(label="grouped resident", experts="grouped", backend="uva", load=dict(offload_gb=0), compile=True),
            dict(label="eager resident", experts="eager", backend="uva", load=dict(offload_gb=0)),
            dict(label="grouped sparse-first/uva", experts="grouped", backend="uva", load=half),
            dict(label="grouped sparse-first/prefetch", experts="grouped", backend="prefetch", load=half, compile=True),
            dict(label="eager sparse-first/prefetch", experts="eager", backend="prefetch", load=half),
            dict(label="grouped experts-whole/uva", experts="grouped", backend="uva", load=whole, compile=True,
                 plan_checks=(_whole_experts,)),
            dict(label="eager experts-whole/uva", experts="eager", backend="uva", load=whole)]


def compiled_section(tmp: Path, args, dev, guard: Guard, checks: Checks, report: dict, write) -> None:
    """Issue 17's loads of both models; results in report["grouped"], written after every step."""
    import moe_offload
    from moe_offload.prompts import PROMPTS
    from moe_offload.tiny.make import make_tiny
    from transformers import AutoTokenizer

    bw = h2d_bandwidth(dev)
    sec = report["grouped"] = {"h2d_bytes_per_s": bw, "margin": MARGIN, "models": {}}
    limit = 2 * args.case_limit      # a compiled load builds the grouped kernels and the compiled step
    for key, family in MODELS.items():
        try:
            with guard.limit(f"grouped: make {key}", args.case_limit):
                folder = make_tiny(tmp / f"grouped-{key}", family=family, hidden=args.hidden, layers=args.layers,
                                   experts=args.experts, top_k=args.top_k, dtype="bfloat16")
                total = moe_offload.plan(folder, offload_gb=0).total_bytes
                cases = _cases(folder, total / 2 / GIB)
        except (StepTimeout, Exception) as exc:
            traceback.print_exc()
            checks.check(f"grouped {key}: make_tiny {family} bf16 and its plans", False, f"{type(exc).__name__}: {exc}")
            continue
        ids = AutoTokenizer.from_pretrained(folder)(PROMPTS[0], return_tensors="pt").input_ids.to(dev)
        enc = {"input_ids": ids, "attention_mask": ids.new_ones(ids.shape)}
        rows = sec["models"][key] = {"family": family, "total_bytes": total, "loads": []}
        ref = None
        for case in cases:
            label = case["label"] = f"{key} {case['label']}"
            if dev.type == "cpu" and key not in CPU_COMPILED:
                case["compile_skip"] = (f"CPU dry run: compiled only for {', '.join(sorted(CPU_COMPILED))} "
                                        "(inductor's C++ builds); every model compiles on CUDA")
            try:
                with guard.limit(label, limit):
                    res = run_load(case, folder, enc, args, dev, checks, tmp, ref)
                if ref is None:
                    ref = res              # the grouped resident run: every later load's reference
                rows["loads"].append({k: v for k, v in res.items() if k not in ("logits", "margins")})
            except StepTimeout as exc:
                checks.check(f"{label}: within {limit} s", False, str(exc))
            except Exception as exc:  # record and go on, as the other sections
                traceback.print_exc()
                checks.check(f"{label}: load, check and decode without error", False,
                             f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            if ref is None:
                checks.check(f"grouped {key}: grouped resident reference", False, "it failed: nothing to compare with")
                break
            write()
    print_table(sec)


def table_rows(sec: dict) -> list[dict]:
    bw = sec.get("h2d_bytes_per_s")
    out = []
    for key, m in sec["models"].items():
        for load in m["loads"]:
            comp = load.get("compiled") or {}
            bpt = load.get("link_bytes_per_token", 0.0)
            step = comp.get("step_s", load["uncompiled"]["step_s"])
            out.append({"model": key, "load": load["label"].split(" ", 1)[1], "tok_s": load["uncompiled"]["tok_s"],
                        "compiled_tok_s": comp.get("tok_s"), "compile_s": comp.get("compile_s"),
                        "link_bytes_per_token": bpt, "step_ms": step * 1e3,
                        "link_floor_ms": bpt / bw * 1e3 if bw else None})
    return out


def print_table(sec: dict) -> None:
    import sys

    from rich.console import Console
    from rich.table import Table

    bw = sec.get("h2d_bytes_per_s")
    t = Table(title="gpu_check grouped/compiled: decode tok/s (1 / median step); link floor = bytes/token / "
                    + (f"{bw / 1e9:.1f} GB/s pinned h2d" if bw else "h2d bandwidth (CUDA only)"))
    for col in ("model", "load", "tok/s", "compiled tok/s", "compile s", "link KiB/tok", "step ms", "floor ms"):
        t.add_column(col, justify="left" if col in ("model", "load") else "right")

    def f(v, spec):
        return "" if v is None else format(v, spec)

    for r in table_rows(sec):
        t.add_row(r["model"], r["load"], f(r["tok_s"], ".1f"), f(r["compiled_tok_s"], ".1f"), f(r["compile_s"], ".1f"),
                  f(r["link_bytes_per_token"] / 1024, ".1f"), f(r["step_ms"], ".3f"), f(r["link_floor_ms"], ".4f"))
    (Console() if sys.stdout.isatty() else Console(width=150)).print(t)
