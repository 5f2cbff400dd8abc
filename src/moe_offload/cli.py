"""moe-offload: plan, load, run and benchmark MoE models whose weights do not fit on the accelerator.

The first line is also `moe-offload --help`'s description. Commands, options and JSON fields are a
stable contract (CLI.md in the project's design notes): extend them, never break them.

Human output goes to the terminal; `--json` prints one JSON document on stdout and nothing
else there. A user error exits with status 2 and one `error:` line on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

from .errors import MoeOffloadError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, per the contract, instead of usage + message
        sys.stderr.write(f"error: {message} (see `{self.prog} --help`)\n")
        sys.exit(2)


def _budget_options(p: argparse.ArgumentParser, *, policy_options: bool = True, oracle: bool = False) -> None:
    """`policy_options=False` (bench, whose --arms choose the policy): --policy and --offload-params are
    left out of --help and parse only so that the command can refuse them with a pointer to --arms."""
    from .planner import DEFAULT_RESERVE_GB

    def shown(text: str) -> str:
        return text if policy_options else argparse.SUPPRESS

    g = p.add_argument_group("budget")
    g.add_argument("--offload-gb", type=float, metavar="X",
                   help="offload at least X GiB of weights to host memory (0 offloads nothing)")
    g.add_argument("--device-memory", type=float, metavar="X",
                   help="the accelerator has X GiB: offload the least that makes weights + reserve fit")
    g.add_argument("--reserve-gb", type=float, metavar="X",
                   help=f"with --device-memory: room kept for activations and KV cache (default {DEFAULT_RESERVE_GB})")
    g.add_argument("--host-memory", type=float, metavar="X",
                   help="the host has X GiB for offloaded weights: what leaves the device beyond it is read from the "
                        "checkpoint on disk, lowest access densities first (on a CPU-only machine --device-memory "
                        "alone already puts what does not fit in RAM on disk)")
    g.add_argument("--policy", default="sparse-first" if policy_options else None,
                   choices=["sparse-first", "declaration", "frequency", *(["oracle"] if oracle else [])],
                   help=shown("sparse-first: by access density, routed experts before dense, globally (default); "
                              "declaration: module declaration order (the legacy behaviour of today's engines); "
                              "frequency: expert by expert, least picked first, from --stats"
                              + ("; oracle: frequency with statistics from --trace itself (a floor)" if oracle
                                 else "")))
    g.add_argument("--stats", nargs="+", metavar="TRACE",
                   help=("with --policy frequency: " if policy_options else "for the frequency arm: ")
                   + "routing traces (`moe-offload profile`) whose decode tokens give each expert's pick frequency")
    g.add_argument("--offload-params", nargs="+", metavar="SEG",
                   help=shown("only tensors whose name contains one of these whole dot-separated segment "
                              "sequences are eligible (`experts` matches `...mlp.experts.down_proj`)"))
    g.add_argument("--dtype", choices=["bf16", "fp16", "fp32"],
                   help="the dtype weights are held in (default: the checkpoint's; from config.json alone, the "
                        "config's own and its quantization_config)")


def _budget_kwargs(args, *, cpu_only: bool = False) -> dict:
    """cpu_only: the plan is for a machine whose device is host memory (`_cpu_only`); the planner stays pure."""
    return dict(offload_gb=args.offload_gb, device_memory_gb=args.device_memory, reserve_gb=args.reserve_gb,
                policy=args.policy, offload_params=args.offload_params, stats=_stats(args.stats),
                host_memory_gb=args.host_memory, cpu_only=cpu_only)


def _cpu_only(device: str | None, *, check: bool = False) -> bool:
    """Whether the device a command plans for is the CPU (then --device-memory bounds RAM and the rest goes to
    disk): --device when given, else this machine's (the accelerator when there is one). `check`: the named
    device must exist here (commands that run the model); plan and replay may name another machine's."""
    from .storage import accelerator_available, resolve_device

    if check:
        return resolve_device(device).type == "cpu"
    if device is None:
        return not accelerator_available()
    import torch

    try:
        return torch.device(device).type == "cpu"
    except (RuntimeError, TypeError):
        raise MoeOffloadError(f"--device {device!r} is not a device name: use cpu, cuda, cuda:1, xpu, ...") from None


def _device_option(p: argparse.ArgumentParser) -> None:
    """--device for commands that plan without running (plan, replay)."""
    p.add_argument("--device", help="the device the plan is for: cpu (no accelerator: --device-memory then bounds RAM "
                                    "and the rest is on disk), cuda, ... (default: this machine's accelerator, else "
                                    "cpu)")


def _stats(paths, check=None) -> dict | None:
    """--stats TRACE...: decode-token picks per expert per layer, summed over the traces (each passed to
    `check` first, when given)."""
    if not paths:
        return None
    from .errors import TraceError
    from .traces import expert_counts, read_trace

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


def _read_plan_of(plan_path: str, model_arg: str, path: Path):
    """--plan PLAN.json, checked to be a plan of MODEL: the same tensor names both ways, so a plan of another
    model (or of another depth of the same family) is an error, not a placement silently applied to the wrong
    tensors."""
    from .errors import PlanMismatchError
    from .inventory import inventory
    from .planner import Plan

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
    from . import plan as make_plan
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


def _runtime_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=["uva", "prefetch"], default="uva",
                   help="uva: offloaded weights read in place through device-visible views of host memory "
                        "(default); prefetch: staged onto the device before use")
    p.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: the accelerator when there is one, else cpu)")
    from .cache_policy import DEFAULT_CACHE_POLICY, cache_policy_names

    p.add_argument("--cache-gb", type=float, metavar="X",
                   help="device-side cache of X GiB for the offloaded routed experts decode steps fetch (a hit reads "
                        "nothing over the link); with --device-memory it is taken out of --reserve-gb (default 0: "
                        "no cache)")
    p.add_argument("--cache-policy", metavar="P",
                   help=f"with --cache-gb: {', '.join(cache_policy_names())} (default {DEFAULT_CACHE_POLICY}; belady, "
                        "the offline optimum, only in replay)")


def load_for_cli(args, **extra):
    """Load MODEL with the command's budget and runtime options; returns (model, plan, tokenizer)."""
    from . import load
    from .inventory import read_config
    from .loader import load_tokenizer

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

    from .device_cache import cache_stats
    from .planner import format_bytes

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

    from .bench import DEFAULT_ARMS, DEFAULT_CONCURRENCY, parse_arms, parse_concurrency, read_prompts, run_bench
    from .plots import plot
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
    from . import planner
    from .frequency import routed_layers
    from .inventory import inventory
    from .planner import format_bytes
    from .replay import replay
    from .traces import check_trace_matches, expert_counts, read_trace

    path = _model_path(args.model)
    trace = read_trace(args.trace)
    budget = dict(offload_gb=args.offload_gb, device_memory_gb=args.device_memory, reserve_gb=args.reserve_gb,
                  host_memory_gb=args.host_memory)
    if args.plan:
        given = [opt for opt, v in (("--offload-gb", args.offload_gb), ("--device-memory", args.device_memory),
                                    ("--reserve-gb", args.reserve_gb), ("--host-memory", args.host_memory),
                                    ("--offload-params", args.offload_params), ("--stats", args.stats),
                                    ("--dtype", args.dtype), ("--device", args.device)) if v is not None]
        if given or args.policy != "sparse-first":
            raise MoeOffloadError(f"--plan and {', '.join(given) or '--policy'} both decide the placement: give "
                                  "--plan alone, or budget options without it")
        plan = _read_plan_of(args.plan, args.model, path)
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
    from .bench import read_prompts
    from .profile import print_summary, profile

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
    from . import plan as make_plan
    from .export import LABELS, export
    from .inventory import read_config
    from .planner import format_bytes

    path = _model_path(args.model)
    config = read_config(path)
    if args.plan:
        given = [opt for opt, v in (("--offload-gb", args.offload_gb), ("--device-memory", args.device_memory),
                                    ("--reserve-gb", args.reserve_gb), ("--host-memory", args.host_memory),
                                    ("--offload-params", args.offload_params), ("--stats", args.stats),
                                    ("--dtype", args.dtype), ("--batch", args.batch)) if v is not None]
        if given or args.policy != "sparse-first":
            raise MoeOffloadError(f"--plan and {', '.join(given) or '--policy'} both decide the placement: give "
                                  "--plan alone, or budget options without it")
        plan = _read_plan_of(args.plan, args.model, path)
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
    from .tiny import make_tiny

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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="moe-offload", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("plan", help="plan where every weight lives (reads no tensor data)")
    p.add_argument("model", help="model folder or config.json path")
    _budget_options(p)
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together, for link bytes (default 1)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON document")
    p.add_argument("--tensors", action="store_true", help="also list every tensor with its role, density and tier")
    p.add_argument("--save", metavar="PLAN.json", help="save the plan (load it with `moe_offload.load(plan=...)`)")
    _device_option(p)
    p.set_defaults(func=cmd_plan)

    g = sub.add_parser("generate", help="greedy decoding with the model loaded into its plan")
    g.add_argument("model", help="model folder (config.json, safetensors, tokenizer)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    _budget_options(g)
    _runtime_options(g)
    g.add_argument("--json", action="store_true", help="print the result as one JSON document")
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="measure offloading arms side by side at one budget (speed and link bytes)")
    b.add_argument("model", help="model folder (config.json, safetensors, tokenizer)")
    b.add_argument("--arms",
                   help="comma-separated: resident (offload nothing; skipped when it does not fit), declaration, "
                        "sparse-first, frequency (expert by expert from --stats TRACE), explicit:SEG[+SEG...], "
                        "accelerate (transformers + accelerate device_map='auto' at the same budget; rest to disk) "
                        "(default: resident,declaration,sparse-first); "
                        "the arms choose the policy and selectors, so bench takes no --policy / --offload-params")
    _budget_options(b, policy_options=False)  # arms choose the policy; an explicit --policy is refused
    _runtime_options(b)
    b.add_argument("--concurrency", metavar="C,C",
                   help="sequences decoded together, one row per level (default 1,4)")
    b.add_argument("--runs", type=int, default=3,
                   help="measured runs per arm and level, after 1 warm-up run (default 3)")
    b.add_argument("--max-new-tokens", type=int, default=32,
                   help="tokens decoded per sequence, EOS ignored (default 32)")
    b.add_argument("--prompts", metavar="FILE", help="one prompt per line (default: the built-in varied prompts)")
    b.add_argument("--same-prompt", action="store_true",
                   help="give every sequence the first prompt (flatters batched link traffic; labelled as such)")
    b.add_argument("--link-gbps", type=float, metavar="X",
                   help="host link bandwidth in GB/s (1e9 bytes/s): adds link ms per token from the measured bytes")
    b.add_argument("--threads", type=int, metavar="N", help="CPU threads for torch while measuring (default: torch's)")
    b.add_argument("--json", metavar="FILE", help="write the rows as one JSON list to FILE (`-`: stdout)")
    b.add_argument("--plot", metavar="FILE.png", help="write a two-panel chart: tok/s and link bytes per token")
    b.set_defaults(func=cmd_bench)

    r = sub.add_parser("replay", help="bytes a placement (and cache) would read for a routing trace, without "
                                      "running the model")
    r.add_argument("model", help="model folder or config.json path (tensor sizes only)")
    r.add_argument("--trace", required=True, metavar="TRACE", help="routing trace whose decode tokens are replayed")
    _budget_options(r, oracle=True)
    r.add_argument("--plan", metavar="PLAN.json", help="replay this saved plan instead of planning from the options")
    r.add_argument("--cache-gb", type=float, metavar="X", help="device-side expert cache of X GiB (default: none)")
    r.add_argument("--cache-policy", metavar="P", help="lru, lfu, ..., or belady (the offline optimum)")
    _device_option(r)
    r.add_argument("--json", action="store_true", help="print the result as one JSON document")
    r.set_defaults(func=cmd_replay)

    from .export import ENGINES

    x = sub.add_parser("export", help="the command-line options that make vLLM, SGLang or llama.cpp apply the plan "
                                      "(or the closest placement they can)")
    x.add_argument("model", help="model folder or config.json path")
    x.add_argument("--engine", required=True, choices=ENGINES, help="the engine to export for")
    _budget_options(x)
    x.add_argument("--batch", type=int, metavar="N", help="sequences decoded together, for link bytes (default 1)")
    x.add_argument("--plan", metavar="PLAN.json", help="export this saved plan instead of planning from the options")
    x.add_argument("--json", action="store_true", help="print the result as one JSON document")
    x.set_defaults(func=cmd_export)

    pr = sub.add_parser("profile", help="record which experts the routers pick, token by token, as a trace")
    pr.add_argument("model", help="model folder (config.json, safetensors, tokenizer)")
    pr.add_argument("--out", required=True, metavar="TRACE", help="the trace file to write (JSON Lines, CLI.md)")
    pr.add_argument("--prompts", metavar="FILE", help="one prompt per line (default: the built-in varied prompts)")
    pr.add_argument("--max-new-tokens", type=int, default=32,
                    help="decode tokens recorded per prompt, each run through the model (default 32)")
    pr.add_argument("--ignore-eos", action="store_true", help="always record --max-new-tokens decode tokens")
    pr.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: the accelerator when there is one, else cpu)")
    pr.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="the dtype weights are held in "
                    "(default: the checkpoint's)")
    pr.add_argument("--json", action="store_true", help="print the per-layer skew summary as one JSON document")
    pr.set_defaults(func=cmd_profile)

    t = sub.add_parser("make-tiny", help="write a small random-weight model folder")
    from .tiny import FAMILIES

    t.add_argument("dir", help="the folder to write (new, or empty)")
    t.add_argument("--family", required=True, metavar="F",
                   help=f"a transformers model family: {', '.join(FAMILIES)}")
    t.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    t.add_argument("--experts", type=int, default=8, help="routed experts per MoE layer (default 8)")
    t.add_argument("--top-k", type=int, default=2, help="experts each token is routed to (default 2)")
    t.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    t.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    t.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"],
                   help="dtype of the saved (unquantized) weights (default float32; bfloat16 with --quant, as the "
                        "released quantized checkpoints store them)")
    t.add_argument("--quant", choices=["fp8", "mxfp4"],
                   help="write the checkpoint quantized, in the released on-disk format: fp8 (e4m3 + "
                        "weight_scale_inv block scales, as DeepSeek-V3 / Qwen3-FP8) or mxfp4 (gpt-oss experts)")
    t.set_defaults(func=cmd_make_tiny)
    return parser


# The library's errors name Python arguments (`offload_gb=5`, `offload_params`); here the user typed flags.
_FLAGS = {"offload_gb": "--offload-gb", "device_memory_gb": "--device-memory", "reserve_gb": "--reserve-gb",
          "offload_params": "--offload-params", "batch": "--batch", "policy": "--policy", "dtype": "--dtype",
          "cache_gb": "--cache-gb", "cache_policy": "--cache-policy", "host_memory_gb": "--host-memory"}


def _as_flags(message: str) -> str:
    """`offload_gb=5` -> `--offload-gb 5`, `offload_params` -> `--offload-params`.

    A plain word ("batch", "policy") is an argument only when written `word=`; a name with an underscore
    always is (prose has none).
    """
    def flag(m: re.Match) -> str:
        name, eq = m.group(1), m.group(2)
        if not eq and "_" not in name:
            return m.group(0)
        return _FLAGS[name] + (" " if eq else "")

    return re.sub(r"\b(" + "|".join(_FLAGS) + r")\b(=?)", flag, message)


def main(argv=None) -> int:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except MoeOffloadError as exc:
        message = _as_flags(" ".join(str(exc).split()))
        sys.stderr.write(f"error: {message}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
