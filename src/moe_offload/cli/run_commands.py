"""The commands that run the model: generate, bench, profile (main.py builds the parser and maps user errors
to one `error:` line and exit status 2).

generate and bench load MODEL into a plan made from the budget options, or into a saved plan
(`--plan PLAN.json`, read and checked against MODEL by options.read_plan_of). Human output goes to the
terminal; `--json` prints one JSON document on stdout and nothing else there. Every check of the user's input
happens before the long work starts (loading, measuring), and nothing is left half-written on error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from ..errors import MoeOffloadError
from .options import (budget_kwargs, check_writable, cpu_only_device, model_path, read_plan_of, routing_stats,
                      write_atomic)


def load_for_cli(args, **extra):
    """Load MODEL with the command's budget (or --plan) and runtime options; returns (model, plan, tokenizer)."""
    from ..api import load
    from ..model.config import read_config
    from ..loading.loader import load_tokenizer

    folder = model_path(args.model)
    if not folder.is_dir():
        raise MoeOffloadError(f"{folder} is a file: generate and bench need the model folder (weights + tokenizer)")
    # The config first: AutoTokenizer reads config.json too, and would report a broken one as a broken tokenizer.
    read_config(folder)
    if args.plan:   # the saved plan, checked against MODEL, instead of the budget options (refused beside it)
        placement = dict(plan=read_plan_of(args, folder))
    else:
        placement = dict(dtype=args.dtype, **budget_kwargs(args, cpu_only=cpu_only_device(args.device, check=True)))
    tokenizer = load_tokenizer(folder)
    model, plan = load(folder, device=args.device, backend=args.backend,
                       progress=not getattr(args, "json", False) and sys.stderr.isatty(), **placement,
                       cache_gb=args.cache_gb, cache_policy=args.cache_policy, experts=args.experts,
                       host_cache_gb=args.host_cache_gb, lookahead=args.lookahead,
                       lookahead_from=args.lookahead_from, disk_read=args.disk_read,
                       expert_compute=args.expert_compute, link_gbps=args.link_gbps, host_gbps=args.host_gbps,
                       host_gflops=args.host_gflops, measure_host=args.measure_host, **extra)
    return model, plan, tokenizer


def cmd_generate(args) -> int:
    import time

    import torch

    from ..run.device_cache import cache_stats
    from ..run.host_cache import host_cache_stats
    from ..run.host_compute import host_compute_stats
    from ..run.lookahead import lookahead_stats
    from ..run.runtime import runtime_of
    from ..planning.placement import format_bytes

    if args.max_new_tokens < 1:
        raise MoeOffloadError(f"--max-new-tokens {args.max_new_tokens}: give at least 1")
    if not args.prompt:
        # The tokenizer would still give the BOS token, and the model would continue from nothing.
        raise MoeOffloadError('--prompt "" is empty: there is no text to continue; give the text to continue, '
                              'e.g. --prompt "The river"')
    model, plan, tokenizer = load_for_cli(args)
    runtime = runtime_of(model)
    enc = tokenizer(args.prompt, return_tensors="pt").to(runtime.device)
    if enc["input_ids"].shape[1] == 0:
        raise MoeOffloadError("the prompt encodes to no tokens: give a non-empty --prompt")
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    from ..measure.timing import TokenClock, past_eos

    if args.ignore_eos:
        # No EOS token at all for this call: decoding runs on past it with the same greedy choices
        # (min_new_tokens would instead forbid the EOS token and so change the text); a pad token given
        # where the checkpoint has none (transformers would take the first EOS id, and there is none left).
        kwargs.update(past_eos(model, tokenizer))
    from ..run.compiled import compile_kwargs, compile_seconds, decoding

    if args.compile:
        kwargs.update(compile_kwargs(model))
    kwargs["streamer"] = clock = TokenClock(runtime.device)   # when each token came: the first step compiles
    runtime.counter.reset()
    runtime.disk_counter.reset()
    runtime.activation_counter.reset()
    start = time.perf_counter()
    with torch.no_grad(), decoding(model) if args.compile else contextlib.nullcontext():
        out = model.generate(**enc, **kwargs)
    elapsed = time.perf_counter() - start
    new = out[0, enc["input_ids"].shape[1]:].tolist()
    # Compiling (the decode step, or the grouped experts kernels) happens in the first decode step: its time
    # beyond a warm step's is reported apart and left out of tokens_per_s.
    compiling = args.compile or runtime.compute.mode.value == "grouped"
    compile_s = compile_seconds([b - a for a, b in zip(clock.times, clock.times[1:])]) if compiling else None
    text = tokenizer.decode(new, skip_special_tokens=True)
    result = {
        "text": text,
        "token_ids": new,
        "device": str(runtime.device),
        "backend": runtime.backend,
        "mechanism": runtime.mechanism,
        "offloaded_bytes": plan.offloaded_bytes,
        "host_bytes": runtime.host_bytes,
        # host link + disk tier; disk_read_bytes_per_token: of which read from the checkpoint (disk_tier.py)
        "link_bytes_per_token": runtime.counter.decode_bytes_per_token() + runtime.disk_counter.decode_bytes_per_token(),
        "host_link_bytes_per_token": runtime.counter.decode_bytes_per_token(),
        "disk_read_bytes_per_token": runtime.disk_counter.decode_bytes_per_token(),
        "disk_read_mechanism": runtime.disk.mechanism if runtime.disk is not None else None,
        "planned_link_bytes_per_token": plan.link_bytes_per_token(1),
        "tokens_per_s": len(new) / (elapsed - (compile_s or 0.0)) if elapsed > (compile_s or 0.0) else None,
        "experts": runtime.compute.mode.value,
        "compile": bool(args.compile),
        "compile_s": compile_s,   # the first compiled step's time beyond a warm one (None uncompiled)
        **cache_stats(runtime.cache),   # cache_policy, cache_bytes, cache_hits, cache_misses, ...: decode steps
        **host_cache_stats(runtime.host_cache),   # host_cache_policy, host_cache_bytes, host_cache_hits, ...
        # lookahead (N), lookahead_hits, lookahead_misses, lookahead_wasted_bytes_per_token,
        # lookahead_cancelled_bytes_per_token, lookahead_recall
        **lookahead_stats(runtime.lookahead, max(len(runtime.counter.calls) - 1, 0)),
        # expert_compute, host_compute_steps, device_compute_steps, experts_on_host; of host_link_bytes_per_token,
        # the activations host compute sent and the weights
        **host_compute_stats(runtime.host_compute),
        "link_activation_bytes_per_token": runtime.activation_counter.decode_bytes_per_token(),
        "link_weight_bytes_per_token": runtime.counter.decode_bytes_per_token()
        - runtime.activation_counter.decode_bytes_per_token(),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{args.prompt}{text}")
    print(f"-- {len(new)} tokens, {result['tokens_per_s']:.1f} tok/s (prefill included) on {runtime.device}, "
          f"backend {runtime.backend}", file=sys.stderr)
    print(f"-- {runtime.mechanism}", file=sys.stderr)
    if compile_s is not None:
        what = "the decode step" if args.compile else "the grouped experts kernels"
        print(f"-- compiling {what} took {compile_s:.1f} s (the first decode step beyond a warm one; left out of "
              "tok/s)", file=sys.stderr)
    print(f"-- offloaded {format_bytes(plan.offloaded_bytes)} (host memory used {format_bytes(runtime.host_bytes)}); "
          f"link bytes per decoded token: measured {format_bytes(result['link_bytes_per_token'])}, "
          f"planned {format_bytes(result['planned_link_bytes_per_token'])}", file=sys.stderr)
    if runtime.disk is not None:
        print(f"-- of which read from the checkpoint by the disk tier: "
              f"{format_bytes(result['disk_read_bytes_per_token'])} per decoded token, "
              f"{format_bytes(runtime.disk.bytes_read)} in {runtime.disk.read_calls} reads in all", file=sys.stderr)
    if runtime.host_cache is not None:
        hc = host_cache_stats(runtime.host_cache)
        print(f"-- host cache {hc['host_cache_policy']} of {format_bytes(hc['host_cache_bytes'])}: "
              f"{hc['host_cache_hits']} hits, {hc['host_cache_misses']} misses over the decode steps", file=sys.stderr)
    if runtime.lookahead is not None:
        print(f"-- look-ahead {result['lookahead']}: {result['lookahead_hits']} reads of picked offloaded experts "
              f"were started before their router asked, {result['lookahead_misses']} were not; "
              f"{format_bytes(result['lookahead_wasted_bytes_per_token'])} per token read ahead in vain, "
              f"{format_bytes(result['lookahead_cancelled_bytes_per_token'])} of wrong guesses dropped unread",
              file=sys.stderr)
    if runtime.host_compute is not None:
        print(f"-- expert compute {result['expert_compute']}: {result['host_compute_steps']} layer steps computed "
              f"their {result['experts_on_host']} off-device experts on the host, {result['device_compute_steps']} "
              f"sent them to the device; of the link bytes per decoded token "
              f"{format_bytes(result['link_activation_bytes_per_token'])} were activations, "
              f"{format_bytes(result['link_weight_bytes_per_token'])} weights", file=sys.stderr)
    if runtime.cache is not None:
        print(f"-- device cache {result['cache_policy']} of {format_bytes(result['cache_bytes'])} "
              f"({format_bytes(result['cache_device_bytes'])} carved): {result['cache_hits']} hits, "
              f"{result['cache_misses']} misses over the decode steps", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    from rich.console import Console

    from ..measure.arms import DEFAULT_CONCURRENCY, arms_of_plan, parse_arms, parse_concurrency, read_prompts
    from ..measure.bench import run_bench
    from ..measure.plots import plot
    from .report import print_table

    if args.policy is not None or args.offload_params:
        raise MoeOffloadError("bench compares policies through --arms, not --policy / --offload-params: "
                              "use e.g. --arms declaration,sparse-first,explicit:experts (and frequency, with "
                              "--stats TRACE)")
    arms = arms_of_plan(parse_arms(args.arms) if args.arms else None, bool(args.plan))
    levels = parse_concurrency(args.concurrency or DEFAULT_CONCURRENCY)
    folder = model_path(args.model)
    plan = None
    if args.plan:   # bench's --policy parses to None (refused above when given): checked as the others' default
        plan = read_plan_of(argparse.Namespace(**{**vars(args), "policy": "sparse-first"}), folder)
    # Fail before the long run, not after it, when an output cannot be written.
    if args.plot and Path(args.plot).suffix.lower() not in (".png", ".svg", ".pdf"):
        raise MoeOffloadError(f"--plot {args.plot}: name a .png (or .svg, .pdf) file")
    for option, out in (("--json", args.json), ("--plot", args.plot)):
        if out and out != "-":
            check_writable(Path(out), option)
    prompts = read_prompts(args.prompts) if args.prompts else None
    rows = run_bench(folder, arms=arms, concurrency=levels, runs=args.runs, max_new_tokens=args.max_new_tokens,
                     offload_gb=args.offload_gb, device_memory_gb=args.device_memory, reserve_gb=args.reserve_gb,
                     host_memory_gb=args.host_memory, cpu_only=cpu_only_device(args.device, check=True),
                     dtype=args.dtype, device=args.device, backend=args.backend, prompts=prompts,
                     same_prompt=args.same_prompt, link_gbps=args.link_gbps, threads=args.threads,
                     cache_gb=args.cache_gb, cache_policy=args.cache_policy, stats=routing_stats(args.stats),
                     plan=plan, progress=sys.stderr.isatty(), experts=args.experts, compile=args.compile,
                     host_cache_gb=args.host_cache_gb, lookahead=args.lookahead,
                     lookahead_from=args.lookahead_from, disk_read=args.disk_read,
                     expert_compute=args.expert_compute, host_gbps=args.host_gbps, host_gflops=args.host_gflops,
                     measure_host=args.measure_host)
    to_stdout = args.json == "-"
    print_table(rows, Console(stderr=True) if to_stdout else None)  # stdout holds only the JSON with --json -
    # Both outputs or neither: the plot (the one that can fail on content) first, then the JSON.
    if args.plot:
        plot(rows, args.plot)
    if args.json:
        text = json.dumps(rows, indent=1)
        if to_stdout:
            print(text)
        else:
            try:
                write_atomic(Path(args.json), text + "\n")
            except MoeOffloadError:
                if args.plot:
                    Path(args.plot).unlink(missing_ok=True)
                raise
            print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def cmd_profile(args) -> int:
    from ..measure.arms import read_prompts
    from ..measure.profile import print_summary, profile

    folder = model_path(args.model)
    if not folder.is_dir():
        raise MoeOffloadError(f"{folder} is a file: profile needs the model folder (weights + tokenizer)")
    prompts = read_prompts(args.prompts) if args.prompts else None
    result = profile(folder, args.out, prompts=prompts, max_new_tokens=args.max_new_tokens, predict=args.predict,
                     ignore_eos=args.ignore_eos, device=args.device, dtype=args.dtype)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print_summary(result)
    return 0
