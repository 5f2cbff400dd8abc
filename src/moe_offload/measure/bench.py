"""The benchmark: offloading arms side by side, at one budget, timed step by step.

An *arm* is one way of choosing what to offload: `resident` (nothing), `declaration`
(module declaration order, today's engines), `sparse-first` (by access density) or
`explicit:SEG[+SEG...]` (only tensors under those name segments). Every arm loads the
model once with `moe_offload.load`, then for each concurrency level c decodes a batch of
c prompts (distinct unless `same_prompt`) with its own greedy loop. The `accelerate` arm is
the peer: transformers + accelerate `device_map="auto"` at the same budget, driven by the same
loop, its disk bytes per token measured from /proc/self/io (see accelerate_arm.py):

    prefill (use_cache) -> token 1          TTFT = prefill + first token
    one forward per later token             ITL  = time between consecutive tokens

always exactly `max_new_tokens` tokens (EOS ignored). One warm-up run per (arm, c) is
discarded, then `runs` runs are measured. Link traffic is what the runtime's LinkCounter
counted during the decode steps (prefill excluded), never derived from model size
(DESIGN.md rule 6). `settings` is read back from the loaded model: which tensors'
bytes actually lie in the host arena, by role.

A device-side expert cache (`cache_gb`, `cache_policy`) is the same for every arm. Each run
(warm-up included) starts with it empty and a fresh policy, as just after load: runs of the
same prompts would otherwise hit on each other's experts. Rows report its hits and misses
over the measured runs' decode steps.

`bf16_link_bytes_per_token` is what the same placement would have read with every offloaded
tensor at 2 bytes per element (for a quantized checkpoint: what bf16 would have cost), from the
measured runs' own routing. Where some offloaded tensor is not 2 bytes per element the routing is
recorded during the measured runs for it (one small device-to-host copy per layer and step);
otherwise the field is the measured figure itself and nothing is recorded.

On a CPU-only machine both tiers are the same memory: times then measure the offload
machinery's overhead, not a link, and link bytes per token is the figure that carries.
"""

from __future__ import annotations

import gc
import inspect
import math
import os
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..errors import MoeOffloadError
from ..planning.planner import format_bytes

NAMED_ARMS = ("resident", "declaration", "sparse-first", "frequency", "accelerate")
DEFAULT_ARMS = "resident,declaration,sparse-first"
DEFAULT_CONCURRENCY = "1,4"
SHOWN_NAMES = 32  # offloaded tensor names listed in `settings`; the count is always exact
CPU_NOTE = ("cpu only: the host tier and the 'device' are the same memory, so the time figures measure the "
            "offload machinery's overhead, not a host link; measured link bytes per token is the figure that "
            "carries over to an accelerator")


# --- arguments ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Arm:
    name: str                        # as given: resident, declaration, sparse-first, explicit:a+b, accelerate
    policy: str | None               # None: resident (offload nothing); "accelerate": transformers + accelerate
    offload_params: tuple[str, ...] = ()

    def load_kwargs(self, budget: dict, stats=None) -> dict:
        """`stats`: the routing statistics the frequency arm places by (the other arms take none)."""
        if self.policy is None:
            return dict(offload_gb=0.0)
        if self.policy == "accelerate":   # the bench's own plan at this budget: accelerate_arm maps it
            return dict(budget)
        kw = dict(budget, policy=self.policy)
        if self.policy == "frequency":
            kw["stats"] = stats
        if self.offload_params:
            kw["offload_params"] = list(self.offload_params)
        return kw


def parse_arms(spec: str | Sequence[str]) -> list[Arm]:
    """`resident,declaration,sparse-first,explicit:experts+shared_expert` -> arms, validated."""
    items = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec)]
    arms: list[Arm] = []
    for item in items:
        if item in NAMED_ARMS:
            arms.append(Arm(item, None if item == "resident" else item))
        elif item.startswith("explicit:"):
            segs = tuple(s.strip() for s in item[len("explicit:"):].split("+"))
            if not all(segs) or any(" " in s or s.strip(".") != s for s in segs):
                raise MoeOffloadError(f"arm {item!r} is malformed: write explicit:SEG or explicit:SEG+SEG, "
                                      "each SEG a dotted name segment sequence such as experts or mlp.experts")
            arms.append(Arm(item, "sparse-first", segs))
        else:
            raise MoeOffloadError(f"unknown arm {item!r}: use resident, declaration, sparse-first, frequency, "
                                  "accelerate or explicit:SEG[+SEG...], comma-separated")
    names = [a.name for a in arms]
    if not arms or len(set(names)) != len(names):
        raise MoeOffloadError(f"--arms {','.join(names)!r}: give each arm once, at least one")
    return arms


def parse_concurrency(spec: str | Sequence[int]) -> list[int]:
    """`1,4` -> [1, 4]: distinct positive integers."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    try:
        levels = [int(str(x).strip()) for x in items]
    except ValueError:
        raise MoeOffloadError(f"--concurrency {spec!r} is not a list of integers: write e.g. 1,4") from None
    if not levels or min(levels) < 1 or len(set(levels)) != len(levels):
        raise MoeOffloadError(f"--concurrency {spec!r}: give distinct sequence counts of at least 1, e.g. 1,4")
    return levels


def read_prompts(path: str | os.PathLike) -> list[str]:
    """One prompt per non-empty line."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise MoeOffloadError(f"cannot read prompts from {path} ({type(exc).__name__}); give a UTF-8 text file "
                              "with one prompt per line") from exc
    return [line.strip() for line in lines if line.strip()]


def _batch_prompts(prompts: Sequence[str], c: int, same_prompt: bool) -> list[str]:
    if same_prompt:
        return [prompts[0]] * c
    return list(prompts[:c])


# --- one run -----------------------------------------------------------------------------

@dataclass
class _Run:
    ttft_s: float
    itl_s: list[float]              # one per decode step (max_new_tokens - 1)
    wall_s: float                   # prefill start -> last token
    decode_link_bytes: list[int]    # LinkCounter bytes of each decode step
    token_ids: torch.Tensor         # [c, max_new_tokens]
    cache_hits: int = 0             # device cache accesses of the run's decode steps (0 without a cache)
    cache_misses: int = 0
    # experts.RoutedCall of each decode step, recorded only where a bf16 comparison needs it (_needs_routing)
    decode_routing: list = field(default_factory=list)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu" and hasattr(torch, "accelerator"):
        torch.accelerator.synchronize()


def _forward_keywords(model) -> tuple[str, bool, bool]:
    """(cache keyword, takes position_ids, takes logits_to_keep) of this model's forward."""
    params = inspect.signature(type(model).forward).parameters
    cache_kw = "cache" if "cache" in params else "past_key_values"  # transformers >= 5.2x renamed it
    return cache_kw, "position_ids" in params, "logits_to_keep" in params


class _RuntimeMeter:
    """Link bytes of each forward as moe_offload's runtime counted them (the `meter` of `_greedy`; the
    accelerate arm has its own, accelerate_arm.AccelerateArm)."""

    def __init__(self, model):
        self.counter = model.moe_offload_runtime.counter
        self.disk = model.moe_offload_runtime.disk_counter

    def before_step(self) -> None:
        pass

    def step(self) -> int:
        # this forward's bytes from the host tier and the disk tier (disk_tier.py)
        return self.counter.calls[-1][1] + self.disk.calls[-1][1]


def _greedy(model, enc, max_new_tokens: int, device: torch.device, meter=None) -> _Run:
    """Greedy decoding, one timed forward per token; exactly max_new_tokens tokens (EOS ignored).

    `meter.before_step()` runs before each forward outside the timed interval, `meter.step()` after it
    gives that forward's link bytes (default: the runtime's LinkCounter)."""
    meter = meter or _RuntimeMeter(model)
    cache_kw, takes_pos, takes_keep = _forward_keywords(model)
    ids, mask = enc["input_ids"], enc["attention_mask"]       # ids, mask: [c, P], left-padded
    extra = {"logits_to_keep": 1} if takes_keep else {}
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)            # [c, P] positions as generate() gives them
    meter.before_step()
    _sync(device)
    start = time.perf_counter()
    out = model(input_ids=ids, attention_mask=mask, use_cache=True, **extra,
                **({"position_ids": pos} if takes_pos else {}))
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)           # [c, 1]
    _sync(device)
    last = time.perf_counter()
    ttft = last - start
    tokens, itl, link = [nxt], [], []
    cache = getattr(out, cache_kw, None)
    assert cache is not None, f"{type(model).__name__} returned no cache with use_cache=True"
    for _ in range(max_new_tokens - 1):
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)   # [c, P + t]
        pos = pos[:, -1:] + 1                                              # [c, 1]
        paused = time.perf_counter()
        meter.before_step()
        last += time.perf_counter() - paused                               # not part of the step
        out = model(input_ids=nxt, attention_mask=mask, use_cache=True, **{cache_kw: cache}, **extra,
                    **({"position_ids": pos} if takes_pos else {}))
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        _sync(device)
        now = time.perf_counter()
        itl.append(now - last)
        last = now
        link.append(meter.step())
        cache = getattr(out, cache_kw, None)
        tokens.append(nxt)
    return _Run(ttft, itl, last - start, link, torch.cat(tokens, dim=1).cpu())


def _measure(model, enc, runs: int, max_new_tokens: int, device: torch.device, describe, advance) -> list[_Run]:
    """One warm-up run (discarded), then `runs` measured runs of the same batch."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    measured = []
    with torch.no_grad():
        for i in range(runs + 1):
            describe("warm-up" if i == 0 else f"run {i}/{runs}")
            model.moe_offload_runtime.counter.reset()
            if i <= 1:   # the disk counter keeps every measured run (the warm-up's steps dropped)
                model.moe_offload_runtime.disk_counter.reset()
            cache = model.moe_offload_runtime.cache
            if cache is not None:
                cache.reset()
            rt, calls = model.moe_offload_runtime, []
            record = i > 0 and _needs_routing(rt.plan)
            if record:   # the routing of the measured runs, for bf16_link_bytes_per_token
                rt.recorder = calls.append
            try:
                run = _greedy(model, enc, max_new_tokens, device)
            finally:
                if record:
                    rt.recorder = None
            run.decode_routing = calls[1:]              # the first call is the prefill
            if cache is not None:
                run.cache_hits, run.cache_misses = cache.policy.hits, cache.policy.misses
            if i > 0:
                measured.append(run)
            advance()
    return measured


def _needs_routing(plan) -> bool:
    """Whether some offloaded tensor is not 2 bytes per element (quantized, fp32): only then does the bf16
    figure differ from the measured one and need the routing."""
    return any(t.tier != "device" and t.bytes != 2 * t.numel for t in plan.tensors)


def link_bytes_from_routing(plan, runs: Sequence[_Run], c: int, *, bf16: bool = False) -> float:
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


# --- read-back -----------------------------------------------------------------------------

def applied_settings(model, plan, *, resident: bool = False) -> dict:
    """The plan as it actually lies in memory: what the host arena holds, by role, and by name.

    `resident`: the arm loaded at a zero budget, whose plan carries the default policy's name although no
    policy chose anything; it is reported as policy "resident" once the arena confirms it holds nothing."""
    rt = model.moe_offload_runtime
    role_of = {t.name: t.role for t in plan.tensors}
    # The scales of a quantized tensor (a buffer beside it, quant_weights.py) count with it, under its role.
    owner_of = {q.scale_name: name for name, q in rt.quant.items()}
    by_role: dict[str, int] = defaultdict(int)
    names: list[str] = []
    tensors = [*model.named_parameters(), *model.named_buffers()]
    for name, t in tensors:
        if rt.arena.owns(t):
            by_role[role_of.get(owner_of.get(name, name), "other")] += t.numel() * t.element_size()
            if name not in owner_of:
                names.append(name)
    out = {
        "policy": "resident" if resident and not names else plan.policy,
        "offload_params": list(plan.offload_params),
        "budget_bytes": plan.budget_bytes,
        "backend": rt.backend,
        "device": str(rt.device),
        "host_bytes_by_role": dict(by_role),
        "offloaded_tensor_count": len(names),
        "offloaded_tensors": names[:SHOWN_NAMES],
        # routed-expert tensors split between tiers: name -> experts on the host (read back: the host part)
        "split_tensors": {name: model.get_parameter(name).shape[0] for name in rt.splits if name in role_of},
        # the device-side expert cache as the runtime holds it: None, or its policy, capacity and carved bytes
        "cache": None if rt.cache is None else {"policy": rt.cache.policy_name, "bytes": rt.cache.capacity_bytes,
                                                 "device_bytes": rt.cache.device_bytes,
                                                 "page_bytes": rt.cache.page_bytes},
    }
    if rt.device.type == "cpu":
        out["threads"] = torch.get_num_threads()
    return out


def device_resident_bytes(model) -> int:
    """Bytes of weights and staging buffers that live on the run device (not in the host arena)."""
    rt = model.moe_offload_runtime
    seen: set[int] = set()
    total = 0
    for _, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.device == rt.device and not rt.arena.owns(t) and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    # The device experts of tensors split between tiers, and the prefetch backend's staging buffers
    # (reused device copies of offloaded weights).
    staging = [split.resident for split in rt.splits.values()] + list(getattr(rt, "_staging", {}).values())
    dense = getattr(rt, "_dense", None)
    staging += [b for b in getattr(dense, "ring", []) if b is not None]
    if rt.dequantizer is not None:   # reused buffers quantized weights are dequantized into
        staging += rt.dequantizer.buffers()
    if rt.cache is not None and rt.cache.arena is not None:
        staging.append(rt.cache.arena)
    return total + sum(b.numel() * b.element_size() for b in staging)


# --- statistics ----------------------------------------------------------------------------

def _percentile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def timing_fields(arm_name: str, c: int, runs: list[_Run], max_new_tokens: int) -> dict:
    """The timing columns of a row, one definition for every arm (see the README's metric definitions)."""
    itl = [s for r in runs for s in r.itl_s]
    itl_p50 = _percentile(itl, 50)
    per_run_wall = [c * max_new_tokens / r.wall_s for r in runs]
    return {
        "arm": arm_name,
        "concurrency": c,
        "runs": len(runs),
        "max_new_tokens": max_new_tokens,
        "itl_samples": len(itl),
        "itl_p50_ms": itl_p50 * 1e3,
        "itl_p90_ms": _percentile(itl, 90) * 1e3,
        "tok_s_itl": c / itl_p50,
        "tok_s_wall": c * max_new_tokens * len(runs) / sum(r.wall_s for r in runs),
        "ttft_ms": statistics.median(r.ttft_s for r in runs) * 1e3,
        "spread_pct": (max(per_run_wall) - min(per_run_wall)) / statistics.median(per_run_wall) * 100,
    }


def measured_link_bytes(c: int, runs: list[_Run]) -> float:
    """Mean bytes read from the offload tiers per decoded token over the measured runs' decode steps."""
    steps = sum(len(r.decode_link_bytes) for r in runs)
    return sum(sum(r.decode_link_bytes) for r in runs) / (steps * c)


def _row(arm: Arm, c: int, runs: list[_Run], model, plan, *, prompts: list[str], same_prompt: bool,
         max_new_tokens: int, link_gbps: float | None, model_name: str, budget_label: str) -> dict:
    rt = model.moe_offload_runtime
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
        "disk_staging_bytes": rt.disk.staging_bytes if rt.disk is not None else 0,
        "planned_link_bytes_per_token": plan.link_bytes_per_token(c),
        # the same placement and routing with every offloaded tensor at 2 bytes per element (quantized: what
        # bf16 would have read); the measured figure itself when nothing offloaded differs from 2 bytes
        "bf16_link_bytes_per_token": bf16_link,
        "cache_policy": None if rt.cache is None else rt.cache.policy_name,
        "cache_bytes": 0 if rt.cache is None else rt.cache.capacity_bytes,
        "cache_hits": sum(r.cache_hits for r in runs),       # over the measured runs' decode steps
        "cache_misses": sum(r.cache_misses for r in runs),
        "host_bytes": rt.host_bytes,
        "device_bytes": int(device_bytes),
        "same_prompt": same_prompt,
        "prompts": prompts,
        "mechanism": rt.mechanism,
        "model": model_name,
        "model_type": plan.model_type,
        "budget": budget_label,
        "settings": settings,
    }
    if link_gbps:
        row["link_ms_per_token"] = link / (link_gbps * 1e9) * 1e3
    return row


# --- the benchmark ---------------------------------------------------------------------------

def _budget_label(offload_gb, device_memory_gb, reserve_gb) -> str:
    if offload_gb is not None:
        return f"offload {offload_gb:g} GiB"
    if device_memory_gb is not None:
        from ..planning.planner import DEFAULT_RESERVE_GB

        reserve = reserve_gb if reserve_gb is not None else DEFAULT_RESERVE_GB
        return f"device memory {device_memory_gb:g} GiB (reserve {reserve:g})"
    return "no budget"


def _load_tokenizer(folder: Path):
    from ..loading.loader import load_tokenizer

    tok = load_tokenizer(folder)
    tok.padding_side = "left"          # decode appends on the right: pad on the left, mask the pads
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def _resident_skip(arm: Arm, model_dir: Path, dtype, budget: dict, device: torch.device) -> str | None:
    """Why the resident arm cannot run at this budget, or None when it fits."""
    from ..api import plan as make_plan

    if budget.get("device_memory_gb") is not None:
        p = make_plan(model_dir, dtype=dtype, **budget)
        if p.offloaded_bytes:
            return (f"resident skipped: the model ({format_bytes(p.total_bytes)}) does not fit "
                    f"{budget['device_memory_gb']:g} GiB of device memory with the reserve; its plan offloads "
                    f"{format_bytes(p.offloaded_bytes)}")
    elif device.type == "cuda":
        total = make_plan(model_dir, dtype=dtype).total_bytes
        free, _ = torch.cuda.mem_get_info(device)
        if total > free:
            return (f"resident skipped: the model ({format_bytes(total)}) is larger than the "
                    f"{format_bytes(free)} free on {device}")
    return None


def run_bench(model_dir, *, arms: Sequence[Arm] | str = DEFAULT_ARMS,
              concurrency: Sequence[int] | str = DEFAULT_CONCURRENCY, runs: int = 3, max_new_tokens: int = 32,
              offload_gb: float | None = None, device_memory_gb: float | None = None,
              reserve_gb: float | None = None, host_memory_gb: float | None = None, cpu_only: bool = False,
              dtype: str | None = None, device=None, backend: str | None = None,
              prompts: Sequence[str] | None = None,
              same_prompt: bool = False, link_gbps: float | None = None, threads: int | None = None,
              cache_gb: float | None = None, cache_policy: str | None = None, stats=None,
              progress: bool = False, log: Callable[[str], None] | None = None) -> list[dict]:
    """Measure every arm at every concurrency level; one row per (arm, concurrency), in that order.

    Skipped arms (resident when the model does not fit) are reported through `log`
    (default: stderr) and have no row. `threads`: CPU threads torch uses while measuring
    (restored afterwards); on a small shared CPU one thread gives much steadier times.
    `cache_gb`, `cache_policy`: one device-side expert cache, the same for every arm (as `load`).
    `host_memory_gb`, `cpu_only`: three-tier planning, as for `moe_offload.plan` (the CLI sets cpu_only from
    the device it resolves). `stats`: routing statistics for the `frequency` arm (layer -> decode-token picks
    per expert, traces.expert_counts), which needs them.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..api import load, plan as make_plan
    from ..run.device_cache import cache_options, check_capacity, reserve_note
    from ..prompts import PROMPTS
    from ..storage.host import resolve_device

    arms = list(arms) if all(isinstance(a, Arm) for a in arms) and not isinstance(arms, str) else parse_arms(arms)
    levels = parse_concurrency(concurrency)
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise MoeOffloadError(f"--runs {runs}: give at least 1 measured run (one more runs first as warm-up)")
    if max_new_tokens < 2:
        raise MoeOffloadError(f"--max-new-tokens {max_new_tokens}: bench needs at least 2 (the first token "
                              "comes from prefill, inter-token latency from the later ones)")
    if link_gbps is not None and not (math.isfinite(link_gbps) and link_gbps > 0):
        raise MoeOffloadError(f"--link-gbps {link_gbps}: give the link bandwidth in GB/s, e.g. 25 for PCIe Gen4 x16")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise MoeOffloadError(f"--threads {threads}: give a number of CPU threads of at least 1")
    prompts = list(PROMPTS if prompts is None else prompts)
    if not prompts:
        raise MoeOffloadError("no prompts given: the prompts file is empty")
    if not same_prompt and len(prompts) < max(levels):
        raise MoeOffloadError(f"{len(prompts)} prompt(s) for concurrency {max(levels)}: each concurrent sequence "
                              "needs its own prompt; give more prompts or --same-prompt")
    used = prompts[:max(levels)]
    if not same_prompt and len(set(used)) < len(used):
        repeated = next(p for p in used if used.count(p) > 1)
        raise MoeOffloadError(f"the first {len(used)} prompts repeat {repeated[:40]!r}: sequences with the same "
                              "prompt route alike and flatter link traffic; give distinct lines, or --same-prompt "
                              "to measure that case on purpose")
    folder = Path(model_dir)
    if not folder.is_dir():
        raise MoeOffloadError(f"{folder} is not a model folder: bench needs config.json, safetensors and a tokenizer")
    if any(a.policy == "frequency" for a in arms) != (stats is not None):
        raise MoeOffloadError("the frequency arm places experts by routing statistics: give it --stats TRACE "
                              "(`moe-offload profile MODEL --out TRACE`)" if stats is None else
                              "--stats feeds the frequency arm: add frequency to --arms, or drop --stats")
    budget = dict(offload_gb=offload_gb, device_memory_gb=device_memory_gb, reserve_gb=reserve_gb,
                  host_memory_gb=host_memory_gb, cpu_only=cpu_only)
    cache_bytes, policy = cache_options(cache_gb, cache_policy)                          # before anything loads
    reserve_note(cache_bytes, policy, device_memory_gb, reserve_gb)
    if offload_gb is None and device_memory_gb is None and any(a.policy for a in arms):
        raise MoeOffloadError("bench compares arms at one budget, and none was given: add --offload-gb X or "
                              "--device-memory X (see `moe-offload plan` for the model's sizes)")
    dev = resolve_device(device)
    console = Console(stderr=True)
    log = log or (lambda msg: console.print(msg, markup=False, highlight=False))
    if device_memory_gb is not None:
        from ..planning.planner import DEFAULT_RESERVE_GB

        fit = make_plan(folder, dtype=dtype, **budget)
        if not fit.offloaded_bytes:  # as `plan` says it: every arm then measures the same unoffloaded model
            reserve = reserve_gb if reserve_gb is not None else DEFAULT_RESERVE_GB
            log(f"note: the model fits: {format_bytes(fit.total_bytes)} of weights + {reserve:g} GiB reserve <= "
                f"{device_memory_gb:g} GiB of device memory, so no arm offloads anything; give a smaller "
                "--device-memory (or --offload-gb X) to compare offloading")

    # Plan every arm first (no tensor data): a bad selector or budget fails before anything runs.
    active: list[Arm] = []
    for arm in arms:
        if arm.policy is None:
            reason = _resident_skip(arm, folder, dtype, budget, dev)
            if reason:
                log(reason)
                continue
        check_capacity(cache_bytes, make_plan(folder, dtype=dtype, **arm.load_kwargs(budget, stats)))
        active.append(arm)
    if not active:
        raise MoeOffloadError("no arm can run at this budget (reasons above): add an arm that offloads, e.g. "
                              "--arms declaration,sparse-first")
    tokenizer = _load_tokenizer(folder)
    label = _budget_label(offload_gb, device_memory_gb, reserve_gb) + (
        f", host memory {host_memory_gb:g} GiB (the rest on disk)" if host_memory_gb is not None else
        ", no host tier (cpu: the rest on disk)" if cpu_only and device_memory_gb is not None else "")

    rows: list[dict] = []
    saved_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    try:
        with Progress(*columns, console=console, transient=True, disable=not progress) as bar:
            task = bar.add_task("bench", total=len(active) * len(levels) * (runs + 1))
            for arm in active:
                bar.update(task, description=f"{arm.name}: loading")
                if arm.policy == "accelerate":   # transformers + accelerate, timed by the same _greedy loop
                    from .accelerate_arm import bench_rows

                    rows += bench_rows(
                        folder, make_plan(folder, dtype=dtype, **arm.load_kwargs(budget, stats)), dev, dtype=dtype,
                        tokenizer=tokenizer, levels=levels, prompts=prompts, same_prompt=same_prompt, runs=runs,
                        max_new_tokens=max_new_tokens, link_gbps=link_gbps, budget_label=label,
                        describe=lambda what: bar.update(task, description=f"{arm.name} {what}"),
                        advance=lambda: bar.advance(task))
                    continue
                from .accelerate_arm import peak_rss_bytes, reset_peak_rss

                tracked, first_row = reset_peak_rss(), len(rows)   # peak RSS over this arm's load and runs
                model, applied = load(folder, device=dev, backend=backend, dtype=dtype, cache_gb=cache_gb,
                                      cache_policy=cache_policy, **arm.load_kwargs(budget, stats))
                try:
                    for c in levels:
                        batch = _batch_prompts(prompts, c, same_prompt)
                        measured = _measure(model, tokenizer(batch, return_tensors="pt", padding=True).to(dev),
                                            runs, max_new_tokens, dev,
                                            lambda what: bar.update(task, description=f"{arm.name} c={c} {what}"),
                                            lambda: bar.advance(task))
                        rows.append(_row(arm, c, measured, model, applied, prompts=batch, same_prompt=same_prompt,
                                         max_new_tokens=max_new_tokens, link_gbps=link_gbps,
                                         model_name=folder.resolve().name, budget_label=label))
                    peak = peak_rss_bytes() if tracked else None
                    for row in rows[first_row:]:
                        row["peak_rss_bytes"] = peak
                finally:
                    # Free this arm before the next one loads: hooks off, model gone, then the host slabs.
                    runtime = model.moe_offload_runtime
                    runtime.detach()
                    arena = runtime.arena
                    del model, applied, runtime
                    gc.collect()
                    arena.release()
                    if dev.type == "cuda":
                        torch.cuda.empty_cache()
    finally:
        torch.set_num_threads(saved_threads)
    return rows
