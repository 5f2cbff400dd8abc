"""The instrument every bench arm is timed and metered by: one greedy run, timed token by token.

    prefill (use_cache) -> token 1          TTFT = prefill + first token
    one forward per later token             ITL  = time between consecutive tokens

always exactly `max_new_tokens` tokens (EOS ignored). A *meter* gives each decode step's link bytes: the
runtime's own counters for moe_offload's arms, accelerate_arm.AccelerateArm for the peer. From the runs
come the timing columns of a row (percentiles of the ITL samples, throughput, spread) and the measured
link bytes per token, one definition for every arm. Also here: the prompts of a batch, and the process's
peak resident memory (RSS), which every arm reports.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
from ..run.runtime import runtime_of


def batch_prompts(prompts: Sequence[str], c: int, same_prompt: bool) -> list[str]:
    if same_prompt:
        return [prompts[0]] * c
    return list(prompts[:c])


# --- one run -----------------------------------------------------------------------------

@dataclass
class Run:
    ttft_s: float
    itl_s: list[float]              # one per decode step (max_new_tokens - 1)
    wall_s: float                   # prefill start -> last token
    decode_link_bytes: list[int]    # LinkCounter bytes of each decode step
    token_ids: torch.Tensor         # [c, max_new_tokens]
    cache_hits: int = 0             # device cache accesses of the run's decode steps (0 without a cache)
    cache_misses: int = 0
    host_cache_hits: int = 0        # the host cache of disk-tier experts, likewise
    host_cache_misses: int = 0
    lookahead: dict = field(default_factory=dict)   # run/lookahead.Lookahead.stats of the run, {} without one
    # run/state.RoutedCall of each decode step, recorded only where a bf16 comparison needs it
    # (runtime_rows.needs_routing)
    decode_routing: list = field(default_factory=list)
    compiled: bool = False          # decoded through the compiled step (run/compiled.py)
    compile_s: float = 0.0          # what compiling it cost (its first step beyond a warm one), 0 uncompiled


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
    """Link bytes of each forward as moe_offload's runtime counted them (the `meter` of `greedy`; the
    accelerate arm has its own, accelerate_arm.AccelerateArm)."""

    def __init__(self, model):
        self.counter = runtime_of(model).counter
        self.disk = runtime_of(model).disk_counter

    def before_step(self) -> None:
        pass

    def step(self) -> int:
        # this forward's bytes from the host tier and the disk tier (disk_tier.py)
        return self.counter.calls[-1][1] + self.disk.calls[-1][1]


def greedy(model, enc, max_new_tokens: int, device: torch.device, meter=None) -> Run:
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
    return Run(ttft, itl, last - start, link, torch.cat(tokens, dim=1).cpu())


def pad_token_id(model, tokenizer=None) -> int:
    """The pad token a generate() call can be given when the model's generation config has none: what transformers
    itself takes (the first EOS id), else the tokenizer's pad / EOS token, else 0."""
    gen = model.generation_config
    if gen.pad_token_id is not None:
        return gen.pad_token_id
    eos = gen.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    for candidate in (*eos, *((tokenizer.pad_token_id, tokenizer.eos_token_id) if tokenizer is not None else ())):
        if isinstance(candidate, int):
            return candidate
    return 0


def past_eos(model, tokenizer=None) -> dict:
    """generate() keyword arguments that decode on past every EOS (exactly max_new_tokens tokens, the same greedy
    choices): no EOS token at all, and an explicit pad token where the generation config has none.

    transformers fills a missing pad token with the first EOS id (`_prepare_special_tokens`); with the EOS list
    emptied it indexes an empty tensor and ends in IndexError. Released configs have no pad_token_id (Qwen3's
    config.json, Mixtral's generation_config.json), so `--ignore-eos` and bench met it on them. With no sequence
    ever finishing, the pad is never written."""
    return {"eos_token_id": [], "pad_token_id": pad_token_id(model, tokenizer)}


class TokenClock:
    """A generate() streamer that notes when each token arrives (the first `put` is the prompt)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.times: list[float] = []
        self.prompt_seen = False

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        _sync(self.device)
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def greedy_generate(model, enc, max_new_tokens: int, device: torch.device, **generate_kwargs) -> Run:
    """The same greedy run through `model.generate` (exactly max_new_tokens tokens, EOS ignored), timed token by
    token: the driver of the compiled decode step (run/compiled.py), which needs generate's static KV cache. Link
    bytes per decode step are the runtime's counters of each forward call (one call per token)."""
    rt = runtime_of(model)
    first = len(rt.counter.calls)
    clock = TokenClock(device)
    from ..run.compiled import decoding

    _sync(device)
    start = time.perf_counter()
    with decoding(model) if "compile_config" in generate_kwargs else contextlib.nullcontext():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, streamer=clock,
                             **past_eos(model), **generate_kwargs)
    _sync(device)
    times = [start, *clock.times]
    itl = [b - a for a, b in zip(times[1:], times[2:])]
    calls = list(zip(rt.counter.calls[first:], rt.disk_counter.calls[first:]))[1:]   # the first is the prefill
    link = [host[1] + disk[1] for host, disk in calls]
    return Run(times[1] - start, itl, times[-1] - start, link, out[:, enc["input_ids"].shape[1]:].cpu())


# --- statistics ----------------------------------------------------------------------------

def _percentile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def timing_fields(arm_name: str, c: int, runs: list[Run], max_new_tokens: int) -> dict:
    """The timing columns of a row, one definition for every arm (docs/cli.md, bench, defines them)."""
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


def measured_link_bytes(c: int, runs: list[Run]) -> float:
    """Mean bytes read from the offload tiers per decoded token over the measured runs' decode steps."""
    steps = sum(len(r.decode_link_bytes) for r in runs)
    return sum(sum(r.decode_link_bytes) for r in runs) / (steps * c)


# --- peak resident memory ---------------------------------------------------------------------

def reset_peak_rss() -> bool:
    """Restart the kernel's peak-RSS record (VmHWM) of this process; False where it cannot (not Linux)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int | None:
    """Peak resident memory (anonymous + file-backed pages) since the last `reset_peak_rss`, or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
