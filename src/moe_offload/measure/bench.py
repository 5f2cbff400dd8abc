"""The benchmark: offloading arms side by side, at one budget, timed step by step.

An *arm* is one way of choosing what to offload (arms.py): `resident` (nothing), `declaration`
(module declaration order, today's engines), `sparse-first` (by access density),
`explicit:SEG[+SEG...]` (only tensors under those name segments), or `plan`, a saved plan applied
as it is (then `resident` is the only other arm). Every arm loads the
model once with `moe_offload.load`, then for each concurrency level c decodes a batch of
c prompts (distinct unless `same_prompt`) with the same greedy loop (timing.py). The `accelerate` arm is
the peer: transformers + accelerate `device_map="auto"` at the same budget, driven by the same
loop, its disk bytes per token measured from /proc/self/io (see accelerate_arm.py):

    prefill (use_cache) -> token 1          TTFT = prefill + first token
    one forward per later token             ITL  = time between consecutive tokens

always exactly `max_new_tokens` tokens (EOS ignored). One warm-up run per (arm, c) is
discarded, then `runs` runs are measured. Link traffic is what the runtime's LinkCounter
counted during the decode steps (prefill excluded), never derived from model size
(docs/design.md, rule 6). `settings` is read back from the loaded model (readback.py): which tensors'
bytes actually lie in the host arena, by role. The rows are made in runtime_rows.py.

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

import math
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..errors import MoeOffloadError
from ..planning.placement import Plan
from ..planning.placement import format_bytes
from .arms import DEFAULT_CONCURRENCY, PLAN_ARM, Arm, arms_of_plan, parse_arms, parse_concurrency
from .runtime_rows import make_row, measure
from .timing import batch_prompts, peak_rss_bytes, reset_peak_rss

CPU_NOTE = ("cpu only: the host tier and the 'device' are the same memory, so the time figures measure the "
            "offload machinery's overhead, not a host link; measured link bytes per token is the figure that "
            "carries over to an accelerator")


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


def run_bench(model_dir, *, arms: Sequence[Arm] | str | None = None,
              concurrency: Sequence[int] | str = DEFAULT_CONCURRENCY, runs: int = 3, max_new_tokens: int = 32,
              offload_gb: float | None = None, device_memory_gb: float | None = None,
              reserve_gb: float | None = None, host_memory_gb: float | None = None, cpu_only: bool = False,
              dtype: str | None = None, device=None, backend: str | None = None,
              prompts: Sequence[str] | None = None,
              same_prompt: bool = False, link_gbps: float | None = None, threads: int | None = None,
              cache_gb: float | None = None, cache_policy: str | None = None, stats=None,
              plan: Plan | None = None, progress: bool = False, experts: str | None = None,
              compile: bool = False, host_cache_gb: float | None = None, lookahead: int = 0,
              lookahead_from: str = "output", disk_read: str = "direct", expert_compute: str = "auto",
              host_gbps: float | None = None, host_gflops: float | None = None, measure_host: bool = False,
              log: Callable[[str], None] | None = None) -> list[dict]:
    """Measure every arm at every concurrency level; one row per (arm, concurrency), in that order.

    Skipped arms (resident when the model does not fit) are reported through `log`
    (default: stderr) and have no row. `threads`: CPU threads torch uses while measuring
    (restored afterwards); on a small shared CPU one thread gives much steadier times.
    `cache_gb`, `cache_policy`: one device-side expert cache, the same for every arm (as `load`).
    `host_memory_gb`, `cpu_only`: three-tier planning, as for `moe_offload.plan` (the CLI sets cpu_only from
    the device it resolves). `stats`: routing statistics for the `frequency` arm (layer -> decode-token picks
    per expert, traces.expert_counts), which needs them. `plan`: a saved plan, benched as the arm `plan`
    (arms.arms_of_plan: `resident` may stand beside it; arms None is the plan alone), instead of a budget.
    `experts` ("eager" / "grouped", as `load`) and `compile` (the decode step compiled, run/compiled.py) apply to
    every arm on our runtime; rows say which, and a compiled row its `compile_s`. `host_cache_gb`: one host-memory
    cache of disk-tier experts, the same for every arm (as `load`; rows carry host_cache_*).
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..api import load, plan as make_plan
    from ..run.device_cache import cache_options, check_capacity, reserve_note
    from ..prompts import PROMPTS
    from ..storage.host import resolve_device

    if arms is not None:
        arms = list(arms) if all(isinstance(a, Arm) for a in arms) and not isinstance(arms, str) else parse_arms(arms)
    arms = arms_of_plan(arms, plan is not None)
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
    if plan is not None and any(v is not None for k, v in budget.items() if k != "cpu_only"):
        raise MoeOffloadError("a saved plan and budget options both decide the placement: give --plan alone, or "
                              "budget options without it")
    cache_bytes, policy = cache_options(cache_gb, cache_policy)                          # before anything loads
    reserve_note(cache_bytes, policy, device_memory_gb, reserve_gb)
    if offload_gb is None and device_memory_gb is None and any(a.policy not in (None, PLAN_ARM) for a in arms):
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
        check_capacity(cache_bytes, plan if arm.policy == PLAN_ARM else
                       make_plan(folder, dtype=dtype, **arm.load_kwargs(budget, stats)))
        active.append(arm)
    if not active:
        raise MoeOffloadError("no arm can run at this budget (reasons above): add an arm that offloads, e.g. "
                              "--arms declaration,sparse-first")
    tokenizer = _load_tokenizer(folder)
    if plan is not None:
        label = f"saved {plan.policy} plan ({format_bytes(plan.offloaded_bytes)} offloaded)"
    else:
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
                if arm.policy == "accelerate":   # transformers + accelerate, timed by the same greedy loop
                    from .accelerate_arm import bench_rows

                    rows += bench_rows(
                        folder, make_plan(folder, dtype=dtype, **arm.load_kwargs(budget, stats)), dev, dtype=dtype,
                        tokenizer=tokenizer, levels=levels, prompts=prompts, same_prompt=same_prompt, runs=runs,
                        max_new_tokens=max_new_tokens, link_gbps=link_gbps, budget_label=label,
                        describe=lambda what: bar.update(task, description=f"{arm.name} {what}"),
                        advance=lambda: bar.advance(task))
                    continue
                tracked, first_row = reset_peak_rss(), len(rows)   # peak RSS over this arm's load and runs
                loaded = load(folder, device=dev, backend=backend, dtype=dtype, cache_gb=cache_gb,
                              cache_policy=cache_policy, experts=experts, host_cache_gb=host_cache_gb,
                              lookahead=lookahead, lookahead_from=lookahead_from, disk_read=disk_read,
                              expert_compute=expert_compute, link_gbps=link_gbps, host_gbps=host_gbps,
                              host_gflops=host_gflops, measure_host=measure_host and not rows,
                              **arm.load_kwargs(budget, stats, plan))
                model, applied = loaded
                try:
                    for c in levels:
                        batch = batch_prompts(prompts, c, same_prompt)
                        measured = measure(model, tokenizer(batch, return_tensors="pt", padding=True).to(dev),
                                           runs, max_new_tokens, dev,
                                           lambda what: bar.update(task, description=f"{arm.name} c={c} {what}"),
                                           lambda: bar.advance(task), compile=compile)
                        rows.append(make_row(arm, c, measured, model, applied, prompts=batch,
                                             same_prompt=same_prompt, max_new_tokens=max_new_tokens,
                                             link_gbps=link_gbps, model_name=folder.resolve().name,
                                             budget_label=label))
                    peak = peak_rss_bytes() if tracked else None
                    for row in rows[first_row:]:
                        row["peak_rss_bytes"] = peak
                finally:
                    # Free this arm before the next one loads: workers, hooks, caches, host slabs, the model.
                    loaded.close()
                    del model, applied, loaded
                    if dev.type == "cuda":
                        torch.cuda.empty_cache()
    finally:
        torch.set_num_threads(saved_threads)
    return rows
