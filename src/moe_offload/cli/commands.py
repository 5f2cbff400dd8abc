"""What each `moe-offload` command does, from its parsed arguments (cli.py builds the parser and maps user
errors to one `error:` line and exit status 2).

Human output goes to the terminal; `--json` prints one JSON document on stdout and nothing else there.
Every check of the user's input happens before the long work starts (loading, measuring), and nothing is
left half-written on error.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from ..errors import MoeOffloadError


def _budget_kwargs(args, *, cpu_only: bool = False) -> dict:
    """cpu_only: the plan is for a machine whose device is host memory (`_cpu_only`); the planner stays pure."""
    return dict(offload_gb=args.offload_gb, device_memory_gb=args.device_memory, reserve_gb=args.reserve_gb,
                policy=args.policy, offload_params=args.offload_params, stats=_stats(args.stats),
                host_memory_gb=args.host_memory, cpu_only=cpu_only)


def _cpu_only(device: str | None, *, check: bool = False) -> bool:
    """Whether the device a command plans for is the CPU (then --device-memory bounds RAM and the rest goes to
    disk): --device when given, else this machine's (the accelerator when there is one). `check`: the named
    device must exist here (commands that run the model); plan and replay may name another machine's."""
    from ..storage.host import accelerator_available, resolve_device

    if check:
        return resolve_device(device).type == "cpu"
    if device is None:
        return not accelerator_available()
    import torch

    try:
        return torch.device(device).type == "cpu"
    except (RuntimeError, TypeError):
        raise MoeOffloadError(f"--device {device!r} is not a device name: use cpu, cuda, cuda:1, xpu, ...") from None


def _stats(paths, check=None) -> dict | None:
    """--stats TRACE...: decode-token picks per expert per layer, summed over the traces (each passed to
    `check` first, when given)."""
    if not paths:
        return None
    from ..errors import TraceError
    from ..formats.traces import expert_counts, read_trace

    traces = [read_trace(path) for path in paths]
    for trace in traces if check else ():
        check(trace)
    counts = expert_counts(traces)
    if not any(sum(c) for c in counts.values()):
        # profile --max-new-tokens 1 already records one decode row: an empty trace stopped at EOS at once
        raise TraceError(f"--stats {' '.join(paths)}: no decode tokens in these traces, so there are no routing "
                         "statistics; profile with --ignore-eos (generation stopped at EOS before any decode step)")
    return counts


def _model_path(value: str) -> Path:
    path = Path(value)
    if not path.exists():
        raise MoeOffloadError(f"{path} does not exist: give a local model folder or a config.json path "
                              "(nothing is fetched from a hub)")
    return path


def _read_plan_of(args, path: Path, *, also: tuple = ()):
    """--plan PLAN.json, checked to be a plan of MODEL: the same tensor names both ways, so a plan of another
    model (or of another depth of the same family) is an error, not a placement silently applied to the wrong
    tensors. Options that would also decide the placement (the budget options, and the command's own `also`:
    (flag, value) pairs) are refused beside it."""
    from ..errors import PlanMismatchError
    from ..model.inventory import inventory
    from ..planning.planner import Plan

    given = [opt for opt, v in (("--offload-gb", args.offload_gb), ("--device-memory", args.device_memory),
                                ("--reserve-gb", args.reserve_gb), ("--host-memory", args.host_memory),
                                ("--offload-params", args.offload_params), ("--stats", args.stats),
                                ("--dtype", args.dtype), *also) if v is not None]
    if given or args.policy != "sparse-first":
        raise MoeOffloadError(f"--plan and {', '.join(given) or '--policy'} both decide the placement: give "
                              "--plan alone, or budget options without it")
    plan_path, model_arg = args.plan, args.model
    try:
        plan = Plan.from_json(Path(plan_path).read_text())
    except OSError as exc:
        raise MoeOffloadError(f"cannot read --plan {plan_path}: {exc.strerror}; save one with `moe-offload "
                              "plan MODEL --save PLAN.json`") from exc
    inv = inventory(path)
    names = {r.name for r in inv.records}
    planned = {t.name for t in plan.tensors}
    stray, missing = sorted(planned - names), sorted(names - planned)
    if plan.model_type != inv.model_type or stray or missing:
        why = (f"it is a {plan.model_type} plan" if plan.model_type != inv.model_type else
               f"{len(stray)} of its tensors (e.g. {stray[0]}) are not in the model" if stray else
               f"it places none of {len(missing)} tensors of the model (e.g. {missing[0]})")
        raise PlanMismatchError(f"--plan {plan_path} is not a plan of {path}: {why}; plan this model with "
                              f"`moe-offload plan {model_arg} --save PLAN.json`")
    return plan


def cmd_plan(args) -> int:
    from ..api import plan as make_plan
    from .report import print_plan

    p = make_plan(_model_path(args.model), dtype=args.dtype, batch=args.batch,
                  **_budget_kwargs(args, cpu_only=_cpu_only(args.device)))
    if args.save:
        _write_atomic(Path(args.save), p.to_json(indent=1))
    if args.json:
        print(p.to_json())
    else:
        if args.tensors:
            from rich.console import Console

            from .report import tensors_table

            Console().print(tensors_table(p))
        print_plan(p)
        if args.save:
            print(f"plan saved to {args.save}")
    return 0


def load_for_cli(args, **extra):
    """Load MODEL with the command's budget and runtime options; returns (model, plan, tokenizer)."""
    from ..api import load
    from ..model.inventory import read_config
    from ..loading.loader import load_tokenizer

    folder = _model_path(args.model)
    if not folder.is_dir():
        raise MoeOffloadError(f"{folder} is a file: generate and bench need the model folder (weights + tokenizer)")
    # The config first: AutoTokenizer reads config.json too, and would report a broken one as a broken tokenizer.
    read_config(folder)
    tokenizer = load_tokenizer(folder)
    model, plan = load(folder, device=args.device, backend=args.backend, dtype=args.dtype,
                       progress=not getattr(args, "json", False) and sys.stderr.isatty(),
                       **_budget_kwargs(args, cpu_only=_cpu_only(args.device, check=True)),
                       cache_gb=args.cache_gb, cache_policy=args.cache_policy, **extra)
    return model, plan, tokenizer


def cmd_generate(args) -> int:
    import time

    import torch

    from ..run.device_cache import cache_stats
    from ..planning.planner import format_bytes

    if args.max_new_tokens < 1:
        raise MoeOffloadError(f"--max-new-tokens {args.max_new_tokens}: give at least 1")
    if not args.prompt:
        # The tokenizer would still give the BOS token, and the model would continue from nothing.
        raise MoeOffloadError('--prompt "" is empty: there is no text to continue; give the text to continue, '
                              'e.g. --prompt "The river"')
    model, plan, tokenizer = load_for_cli(args)
    runtime = model.moe_offload_runtime
    enc = tokenizer(args.prompt, return_tensors="pt").to(runtime.device)
    if enc["input_ids"].shape[1] == 0:
        raise MoeOffloadError("the prompt encodes to no tokens: give a non-empty --prompt")
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    if args.ignore_eos:
        # No EOS token at all for this call: decoding runs on past it with the same greedy choices
        # (min_new_tokens would instead forbid the EOS token and so change the text).
        kwargs["eos_token_id"] = []
    runtime.counter.reset()
    runtime.disk_counter.reset()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**enc, **kwargs)
    elapsed = time.perf_counter() - start
    new = out[0, enc["input_ids"].shape[1]:].tolist()
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
        "tokens_per_s": len(new) / elapsed if elapsed > 0 else None,
        **cache_stats(runtime.cache),   # cache_policy, cache_bytes, cache_hits, cache_misses, ...: decode steps
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{args.prompt}{text}")
    print(f"-- {len(new)} tokens, {result['tokens_per_s']:.1f} tok/s (prefill included) on {runtime.device}, "
          f"backend {runtime.backend}", file=sys.stderr)
    print(f"-- {runtime.mechanism}", file=sys.stderr)
    print(f"-- offloaded {format_bytes(plan.offloaded_bytes)} (host memory used {format_bytes(runtime.host_bytes)}); "
          f"link bytes per decoded token: measured {format_bytes(result['link_bytes_per_token'])}, "
          f"planned {format_bytes(result['planned_link_bytes_per_token'])}", file=sys.stderr)
    if runtime.disk is not None:
        print(f"-- of which read from the checkpoint by the disk tier: "
              f"{format_bytes(result['disk_read_bytes_per_token'])} per decoded token, "
              f"{format_bytes(runtime.disk.bytes_read)} in {runtime.disk.read_calls} reads in all", file=sys.stderr)
    if runtime.cache is not None:
        print(f"-- device cache {result['cache_policy']} of {format_bytes(result['cache_bytes'])} "
              f"({format_bytes(result['cache_device_bytes'])} carved): {result['cache_hits']} hits, "
              f"{result['cache_misses']} misses over the decode steps", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    from rich.console import Console

    from ..measure.bench import DEFAULT_ARMS, DEFAULT_CONCURRENCY, parse_arms, parse_concurrency, read_prompts, run_bench
    from ..measure.plots import plot
    from .report import print_table

    if args.policy is not None or args.offload_params:
        raise MoeOffloadError("bench compares policies through --arms, not --policy / --offload-params: "
                              "use e.g. --arms declaration,sparse-first,explicit:experts (and frequency, with "
                              "--stats TRACE)")
    arms = parse_arms(args.arms or DEFAULT_ARMS)
    levels = parse_concurrency(args.concurrency or DEFAULT_CONCURRENCY)
    folder = _model_path(args.model)
    # Fail before the long run, not after it, when an output cannot be written.
    if args.plot and Path(args.plot).suffix.lower() not in (".png", ".svg", ".pdf"):
        raise MoeOffloadError(f"--plot {args.plot}: name a .png (or .svg, .pdf) file")
    for option, out in (("--json", args.json), ("--plot", args.plot)):
        if out and out != "-":
            _check_writable(Path(out), option)
    prompts = read_prompts(args.prompts) if args.prompts else None
    rows = run_bench(folder, arms=arms, concurrency=levels, runs=args.runs, max_new_tokens=args.max_new_tokens,
                     offload_gb=args.offload_gb, device_memory_gb=args.device_memory, reserve_gb=args.reserve_gb,
                     host_memory_gb=args.host_memory, cpu_only=_cpu_only(args.device, check=True),
                     dtype=args.dtype, device=args.device, backend=args.backend, prompts=prompts,
                     same_prompt=args.same_prompt, link_gbps=args.link_gbps, threads=args.threads,
                     cache_gb=args.cache_gb, cache_policy=args.cache_policy, stats=_stats(args.stats),
                     progress=sys.stderr.isatty())
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
                _write_atomic(Path(args.json), text + "\n")
            except MoeOffloadError:
                if args.plot:
                    Path(args.plot).unlink(missing_ok=True)
                raise
            print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def cmd_replay(args) -> int:
    from ..planning import planner
    from ..planning.frequency import routed_layers
    from ..model.inventory import inventory
    from ..planning.planner import format_bytes
    from ..routing.replay import replay
    from ..formats.traces import check_trace_matches, expert_counts, read_trace

    path = _model_path(args.model)
    trace = read_trace(args.trace)
    budget = dict(offload_gb=args.offload_gb, device_memory_gb=args.device_memory, reserve_gb=args.reserve_gb,
                  host_memory_gb=args.host_memory)
    if args.plan:
        plan = _read_plan_of(args, path, also=(("--device", args.device),))
    else:
        inv = inventory(path, dtype=args.dtype)
        layers = routed_layers(inv)

        def check(t):
            check_trace_matches(t, num_experts=inv.num_experts, layers=layers, where=f"the {inv.model_type} model "
                                f"{path}")

        check(trace)
        policy, stats = args.policy, _stats(args.stats, check)
        if policy == "oracle":
            if args.stats:
                raise MoeOffloadError("--policy oracle takes its statistics from --trace itself: drop --stats, or "
                                      "use --policy frequency --stats TRACE")
            policy, stats = "frequency", expert_counts(trace)
        plan = planner.plan(inv, policy=policy, offload_params=args.offload_params, stats=stats,
                            cpu_only=_cpu_only(args.device), **budget)
    result = replay(plan, trace, cache_gb=args.cache_gb, cache_policy=args.cache_policy,
                    policy="oracle" if args.policy == "oracle" else None)
    if args.json:
        print(json.dumps(result.to_dict()))
        return 0
    cache = (f"{result.cache_policy} cache of {format_bytes(result.cache_bytes)}: {result.cache_hits} hits, "
             f"{result.cache_misses} misses" if result.cache_policy else "no cache")
    print(f"{result.tokens} decode tokens of {args.trace} under {result.policy} "
          f"({format_bytes(result.offloaded_bytes)} offloaded), {cache}")
    print(f"link bytes per decoded token: {format_bytes(result.link_bytes_per_token)} "
          f"({result.expert_reads} expert reads over the link; the plan expected "
          f"{format_bytes(plan.link_bytes_per_token(1))} per token)")
    if plan.disk_bytes:
        print(f"of which from host memory {format_bytes(result.host_link_bytes_per_token)}, from disk "
              f"{format_bytes(result.disk_read_bytes_per_token)} per token")
    return 0


def cmd_profile(args) -> int:
    from ..measure.bench import read_prompts
    from ..measure.profile import print_summary, profile

    folder = _model_path(args.model)
    if not folder.is_dir():
        raise MoeOffloadError(f"{folder} is a file: profile needs the model folder (weights + tokenizer)")
    prompts = read_prompts(args.prompts) if args.prompts else None
    result = profile(folder, args.out, prompts=prompts, max_new_tokens=args.max_new_tokens,
                     ignore_eos=args.ignore_eos, device=args.device, dtype=args.dtype)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print_summary(result)
    return 0


def cmd_export(args) -> int:
    from ..api import plan as make_plan
    from ..engines.export import LABELS, export
    from ..model.inventory import read_config
    from ..planning.planner import format_bytes

    path = _model_path(args.model)
    config = read_config(path)
    if args.plan:
        plan = _read_plan_of(args, path, also=(("--batch", args.batch),))
    else:
        plan = make_plan(path, dtype=args.dtype, batch=args.batch or 1, **_budget_kwargs(args))
    text = getattr(config, "text_config", None) or config
    result = export(plan, args.engine, device_memory_gb=args.device_memory, reserve_gb=args.reserve_gb,
                    max_position_embeddings=getattr(text, "max_position_embeddings", None))
    model = str(path.parent if path.is_file() else path)
    if args.json:
        print(json.dumps(result.to_dict(model)))
        return 0
    print(result.command(model))
    for note in result.notes:
        print(f"- {note}")
    what = "the plan exactly" if result.expressible else f"the closest placement {LABELS[result.engine]} can apply"
    print(f"-- {what}: "
          f"{format_bytes(result.link_bytes_per_token)} over the link per decoded token, "
          f"{format_bytes(result.placement.offloaded_bytes)} offloaded (the plan: "
          f"{format_bytes(plan.link_bytes_per_token())}, {format_bytes(plan.offloaded_bytes)})")
    return 0


def cmd_make_tiny(args) -> int:
    from ..tiny.make import make_tiny

    try:
        out = make_tiny(args.dir, family=args.family, layers=args.layers, experts=args.experts, top_k=args.top_k,
                        hidden=args.hidden, seed=args.seed, dtype=args.dtype, quant=args.quant)
    except ValueError as exc:
        raise MoeOffloadError(str(exc)) from exc
    except OSError as exc:
        if exc.errno is None:  # make_tiny's own refusal (target checked before building): its message says it all
            raise MoeOffloadError(str(exc)) from exc
        raise MoeOffloadError(f"cannot write a tiny model to {args.dir}: {exc.strerror} ({exc.filename}); "
                              "choose a new or empty directory you can write to") from exc
    print(f"wrote a tiny {args.family} model to {out}")
    return 0


def _check_writable(path: Path, option: str) -> None:
    """Refuse an output file that could not be written: a directory, or a folder missing or not writable.

    Writability is probed by creating (and removing) a file there: permission bits say nothing for root,
    nor on read-only or virtual file systems."""
    if path.is_dir():
        example = path / ("bench.json" if option == "--json" else "bench.png")
        raise MoeOffloadError(f"{option} {path} is a directory: name a file to write, e.g. {example}")
    folder = path.parent
    if not folder.is_dir():
        why = "is not a folder" if folder.exists() else "does not exist"
        raise MoeOffloadError(f"cannot write {option} {path}: {folder} {why}; create the folder first or choose "
                              "another path")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.probe", dir=folder)
    except OSError as exc:
        raise MoeOffloadError(f"cannot write {option} {path}: the folder {folder} is not writable ({exc.strerror}); "
                              "choose a folder you can write to") from exc
    os.close(fd)
    os.unlink(probe)


def _write_atomic(path: Path, text: str) -> None:
    """Write a file whole or not at all (a temporary sibling renamed into place)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise MoeOffloadError(f"cannot write {path}: {exc.strerror}; choose a writable path") from exc
