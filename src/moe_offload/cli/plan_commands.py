"""The commands that plan without running the model: plan, replay, export, and make-tiny, which writes a
model to plan and run (main.py builds the parser and maps user errors to one `error:` line and exit status 2).

Human output goes to the terminal; `--json` prints one JSON document on stdout and nothing else there.
Every check of the user's input happens before any file is written, and nothing is left half-written on error.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import MoeOffloadError
from .options import budget_kwargs, cpu_only_device, model_path, read_plan_of, routing_stats, write_atomic


def cmd_plan(args) -> int:
    from ..api import plan as make_plan
    from .report import print_plan

    p = make_plan(model_path(args.model), dtype=args.dtype, batch=args.batch,
                  **budget_kwargs(args, cpu_only=cpu_only_device(args.device)))
    if args.save:
        write_atomic(Path(args.save), p.to_json(indent=1))
    if args.json:
        print(p.to_json())
    else:
        if args.tensors:
            from rich.console import Console

            from .report import tensors_table

            Console().print(tensors_table(p))
        print_plan(p)
        crossover = _crossover(args, p)
        if crossover:
            print(crossover)
        if args.save:
            print(f"plan saved to {args.save}")
    return 0


def _crossover(args, plan) -> str | None:
    """The expert-compute line of `plan`: from how many tokens per step the off-device experts travel to the device
    rather than being computed on the host (planning/cost_model.crossover_tokens, uniform routing)."""
    import math
    import sys

    from ..planning.cost_model import Hardware, crossover_tokens, expected_step, layer_shape

    for flag, v in (("--link-gbps", args.link_gbps), ("--host-gbps", args.host_gbps),
                    ("--host-gflops", args.host_gflops)):
        if v is not None and not (math.isfinite(v) and v > 0):
            raise MoeOffloadError(f"{flag} {v} is not a rate: give a positive number")
    shape = layer_shape(plan)
    cpu = cpu_only_device(args.device)
    if cpu and args.link_gbps is not None:
        raise MoeOffloadError(f"--link-gbps {args.link_gbps} for a CPU-only plan: a CPU has no link, its experts are "
                              "read in place; drop --link-gbps, or plan for an accelerator (--device cuda)")
    if shape is None:
        return None
    if cpu:
        return "expert compute: CPU only, the device is the host: offloaded experts are computed where they lie"
    link = args.link_gbps * 1e9 if args.link_gbps is not None else _measured_link(args.device)
    if link is None:
        return ("expert compute: give --link-gbps X (PCIe 4 x16 about 25, PCIe 5 about 50) for the tokens per step "
                "from which offloaded experts travel to the device rather than being computed on the host")
    from ..kernels.host_rates import measure

    say = lambda line: print(line, file=sys.stderr, flush=True)   # noqa: E731
    rates = measure(progress=say) if args.host_gbps is None or args.host_gflops is None else None
    hw = Hardware(args.host_gbps * 1e9 if args.host_gbps is not None else rates.bytes_per_s,
                  args.host_gflops * 1e9 if args.host_gflops is not None else rates.flops_per_s, link)
    n, one = crossover_tokens(hw, shape), expected_step(hw, shape, 1)
    where = (f"computed on the host up to {n - 1} tokens per step, sent to the device from {n}" if n and n > 1
             else "sent to the device at every step size" if n == 1 else "computed on the host at every step size")
    return (f"expert compute (auto, cost model; uniform routing): off-device experts are {where} (host "
            f"{hw.host_bytes_per_s / 1e9:.1f} GB/s and {hw.host_flops_per_s / 1e9:.0f} GFLOP/s, link {link / 1e9:.1f} "
            f"GB/s; a decode step's layer: host {one.host_s * 1e3:.3g} ms, streamed {one.stream_s * 1e3:.3g} ms)")


def _measured_link(device: str | None) -> float | None:
    """This machine's link to the planned device, measured once (kernels/host_rates.py), when it is a CUDA device
    here; None otherwise (a plan for another machine: give --link-gbps)."""
    import torch

    try:
        dev = torch.device(device) if device else (torch.device("cuda") if torch.cuda.is_available() else None)
    except (RuntimeError, TypeError):
        return None
    if dev is None or dev.type != "cuda" or not torch.cuda.is_available():
        return None
    from ..kernels.host_rates import link_bytes_per_s

    return link_bytes_per_s(dev)


def cmd_replay(args) -> int:
    from ..planning import planner
    from ..planning.frequency import routed_layers
    from ..model.inventory import inventory
    from ..planning.placement import format_bytes
    from ..routing.replay import replay
    from ..formats.traces import check_trace_matches, expert_counts, read_trace

    path = model_path(args.model)
    trace = read_trace(args.trace)
    budget = dict(offload_gb=args.offload_gb, device_memory_gb=args.device_memory, reserve_gb=args.reserve_gb,
                  host_memory_gb=args.host_memory)
    predict = _prediction(args)   # checked before any planning; with --plan, --device names the machine predicted
    if args.plan:
        plan = read_plan_of(args, path, also=() if predict else (("--device", args.device),))
    else:
        inv = inventory(path, dtype=args.dtype)
        layers = routed_layers(inv)

        def check(t):
            check_trace_matches(t, num_experts=inv.num_experts, layers=layers, where=f"the {inv.model_type} model "
                                f"{path}")

        check(trace)
        policy, stats = args.policy, routing_stats(args.stats, check)
        if policy == "oracle":
            if args.stats:
                raise MoeOffloadError("--policy oracle takes its statistics from --trace itself: drop --stats, or "
                                      "use --policy frequency --stats TRACE")
            policy, stats = "frequency", expert_counts(trace)
        cpu_only = cpu_only_device(args.device)
        if args.host_cache_gb is not None:   # carved out of the host budget as load carves it: the runtime's plan
            from ..run.host_cache import carve, host_cache_bytes

            carved = carve(host_cache_bytes(args.host_cache_gb), {**budget, "cpu_only": cpu_only}, planned=False)[0]
            budget = {k: v for k, v in carved.items() if k != "cpu_only"}
        plan = planner.plan(inv, policy=policy, offload_params=args.offload_params, stats=stats,
                            cpu_only=cpu_only, **budget)
    result = replay(plan, trace, cache_gb=args.cache_gb, cache_policy=args.cache_policy,
                    policy="oracle" if args.policy == "oracle" else None, host_cache_gb=args.host_cache_gb)
    compute = None
    if predict:
        from ..routing.replay_compute import compute_replay

        compute = compute_replay(plan, trace, predict[0], predict[1], cache_gb=args.cache_gb,
                                 cache_policy=args.cache_policy, host_cache_gb=args.host_cache_gb)
    if args.json:
        doc = result.to_dict()
        doc.update({k: v for k, v in (compute.to_dict() if compute else {}).items() if k not in doc})
        print(json.dumps(doc))
        return 0
    cache = (f"{result.cache_policy} cache of {format_bytes(result.cache_bytes)}: {result.cache_hits} hits, "
             f"{result.cache_misses} misses" if result.cache_policy else "no cache")
    if result.host_cache_policy:
        cache += (f"; host cache {result.host_cache_policy} of {format_bytes(result.host_cache_bytes)}: "
                  f"{result.host_cache_hits} hits, {result.host_cache_misses} misses")
    print(f"{result.tokens} decode tokens of {args.trace} under {result.policy} "
          f"({format_bytes(result.offloaded_bytes)} offloaded), {cache}")
    print(f"link bytes per decoded token: {format_bytes(result.link_bytes_per_token)} "
          f"({result.expert_reads} expert reads over the link; the plan expected "
          f"{format_bytes(plan.link_bytes_per_token(1))} per token)")
    if result.lookahead_hits is not None:
        print(f"look-ahead (the trace's predictions): {result.lookahead_hits} reads of offloaded experts predicted, "
              f"{result.lookahead_misses} not; {format_bytes(result.lookahead_wasted_bytes_per_token)} per token "
              "of wrong guesses (read in vain unless dropped before their read)")
    if plan.disk_bytes:
        print(f"of which from host memory {format_bytes(result.host_link_bytes_per_token)}, from disk "
              f"{format_bytes(result.disk_read_bytes_per_token)} per token")
    if compute:
        _print_prediction(compute)
    return 0


_RATES = (("--link-gbps", "link_gbps", "GB/s"), ("--host-gbps", "host_gbps", "GB/s"),
          ("--host-gflops", "host_gflops", "GFLOP/s"), ("--device-gbps", "device_gbps", "GB/s"),
          ("--device-tflops", "device_tflops", "TFLOP/s"))


def _prediction(args):
    """replay's host-compute prediction, when asked (--expert-compute or a rate): (mode, cost_model.Hardware) for
    the machine the flags describe, or None. The rates are the user's: replay predicts another machine, so nothing
    of this one is measured. A link means an accelerator; --device cpu (or no --device on a machine without one)
    has none."""
    import math

    from ..planning.cost_model import ExpertCompute, Hardware

    given = {flag: getattr(args, name) for flag, name, _ in _RATES if getattr(args, name) is not None}
    if args.expert_compute is None and not given:
        return None
    for flag, name, unit in _RATES:
        v = given.get(flag)
        if v is not None and not (math.isfinite(v) and v > 0):
            raise MoeOffloadError(f"{flag} {v} is not a rate: give a positive number of {unit}")
    mode = ExpertCompute(args.expert_compute or "device")
    cpu = cpu_only_device(args.device)
    where = f"--device {args.device}" if args.device else "no --device, and this machine has no accelerator"
    if cpu and "--link-gbps" in given:
        raise MoeOffloadError(f"--link-gbps {given['--link-gbps']} for a CPU-only machine ({where}): it has no link, "
                              "its experts are read in place; drop --link-gbps, or name an accelerator (--device cuda)")
    if not cpu and "--link-gbps" not in given:
        raise MoeOffloadError(f"--expert-compute {mode.value} on an accelerator ({args.device or 'this machine'}) "
                              "needs the link's rate: give --link-gbps X (PCIe 4 x16 about 25, PCIe 5 about 50)")
    host = [f for f in ("--host-gbps", "--host-gflops") if f not in given]
    if host and (mode is not ExpertCompute.DEVICE or cpu):
        why = ("the host side is timed by them" if mode is not ExpertCompute.DEVICE
               else "on a CPU-only machine every expert is computed by the host")
        raise MoeOffloadError(f"--expert-compute {mode.value} needs the host's rates, and {' and '.join(host)} "
                              f"{'is' if len(host) == 1 else 'are'} missing ({why}): give {' and '.join(host)} "
                              "of the machine predicted (e.g. --host-gbps 80 --host-gflops 1000); replay does not "
                              "measure this one")

    def rate(flag: str, scale: float) -> float | None:
        return given[flag] * scale if flag in given else None

    return mode, Hardware(host_bytes_per_s=rate("--host-gbps", 1e9), host_flops_per_s=rate("--host-gflops", 1e9),
                          link_bytes_per_s=None if cpu else rate("--link-gbps", 1e9),
                          device_flops_per_s=rate("--device-tflops", 1e12),
                          device_bytes_per_s=rate("--device-gbps", 1e9))


def _print_prediction(c) -> None:
    from ..planning.placement import format_bytes

    hw = c.hardware

    def rate(key: str, scale: float, unit: str) -> str | None:
        return f"{hw[key] / scale:g} {unit}" if hw.get(key) else None

    parts = [f"link {rate('link_bytes_per_s', 1e9, 'GB/s') or 'none (CPU only)'}"]
    if hw.get("host_bytes_per_s") and (c.expert_compute != "device" or not hw.get("link_bytes_per_s")):
        parts.append(f"host {rate('host_bytes_per_s', 1e9, 'GB/s')} and {rate('host_flops_per_s', 1e9, 'GFLOP/s')}")
    parts.append(f"device {rate('device_bytes_per_s', 1e9, 'GB/s') or 'memory not limiting'}"
                 + (f", {rate('device_flops_per_s', 1e12, 'TFLOP/s')}" if hw.get("device_flops_per_s") else ""))
    print(f"expert compute {c.expert_compute}, predicted for {', '.join(parts)}: {c.expected_ms_per_token:.4g} ms "
          f"per decoded token (layer steps {c.expert_ms_per_token:.4g} + dense weights {c.dense_ms_per_token:.4g})")
    print(f"per token: link weights {format_bytes(c.link_weight_bytes_per_token)}, link activations "
          f"{format_bytes(c.link_activation_bytes_per_token)}, host memory read by host compute "
          f"{format_bytes(c.host_read_bytes_per_token)}; {c.experts_on_host} experts computed on the host, "
          f"{c.experts_on_device} on the device ({c.steps_on_host} of {c.steps} layer steps on the host)")
    print(f"a prediction, not a measurement: {c.formula}")


def cmd_export(args) -> int:
    from ..api import plan as make_plan
    from ..engines.engine import LABELS
    from ..engines.export import export
    from ..model.config import read_config
    from ..planning.placement import format_bytes

    path = model_path(args.model)
    config = read_config(path)
    if args.plan:
        plan = read_plan_of(args, path, also=(("--batch", args.batch),))
    else:
        plan = make_plan(path, dtype=args.dtype, batch=args.batch or 1, **budget_kwargs(args))
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
    import json

    from ..planning.placement import format_bytes
    from ..tiny.make_like import make_like
    from ..tiny.make import make_tiny

    quant = args.quant
    try:
        if args.like is not None:
            out = make_like(args.dir, args.like, family=args.family, layers=args.layers, experts=args.experts,
                            top_k=args.top_k, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                            head_dim=args.head_dim, expert_ffn=args.expert_ffn, dense_ffn=args.dense_ffn,
                            vocab_size=args.vocab, seed=args.seed, dtype=args.dtype, quant=quant)
        else:
            if args.family is None:
                raise MoeOffloadError("make-tiny needs --family F (a transformers model family) or --like CONFIG "
                                      "(a released model's config.json, whose model_type is the family)")

            def given(value, default):
                return default if value is None else value

            out = make_tiny(args.dir, family=args.family, layers=given(args.layers, 2),
                            experts=given(args.experts, 8), top_k=given(args.top_k, 2), hidden=given(args.hidden, 64),
                            heads=given(args.heads, 4), kv_heads=args.kv_heads, head_dim=args.head_dim,
                            expert_ffn=args.expert_ffn, dense_ffn=args.dense_ffn, vocab_size=given(args.vocab, 512),
                            seed=args.seed, dtype=args.dtype, quant=None if quant == "none" else quant)
    except ValueError as exc:
        raise MoeOffloadError(str(exc)) from exc
    except OSError as exc:
        if exc.errno is None:  # make_tiny's own refusal (target checked before building): its message says it all
            raise MoeOffloadError(str(exc)) from exc
        raise MoeOffloadError(f"cannot write a tiny model to {args.dir}: {exc.strerror} ({exc.filename}); "
                              "choose a new or empty directory you can write to") from exc
    record = json.loads((out / "moe_offload_tiny.json").read_text())
    like = record.get("like")
    if like is None:
        print(f"wrote a tiny {record['family']} model to {out}")
    else:
        size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
        print(f"wrote a {record['family']} model like {like['source']} ({record['layers']} of its "
              f"{like['released_layers']} layers, {format_bytes(size)} of weights"
              f"{', ' + record['quant'] if record['quant'] else ''}) to {out}")
    return 0
