"""What the commands share about their options: the budget options as the planner's keyword arguments, the
device a plan is for, routing statistics, the model path, a saved plan read and checked against MODEL, and
output files checked before the long work and written whole or not at all.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..errors import MoeOffloadError


def budget_kwargs(args, *, cpu_only: bool = False) -> dict:
    """cpu_only: the plan is for a machine whose device is host memory (`cpu_only_device`); the planner stays pure."""
    return dict(offload_gb=args.offload_gb, device_memory_gb=args.device_memory, reserve_gb=args.reserve_gb,
                policy=args.policy, offload_params=args.offload_params, stats=routing_stats(args.stats),
                host_memory_gb=args.host_memory, cpu_only=cpu_only)


def cpu_only_device(device: str | None, *, check: bool = False) -> bool:
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


def routing_stats(paths, check=None) -> dict | None:
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


def model_path(value: str) -> Path:
    path = Path(value)
    if not path.exists():
        raise MoeOffloadError(f"{path} does not exist: give a local model folder or a config.json path "
                              "(nothing is fetched from a hub)")
    return path


def read_plan_of(args, path: Path, *, also: tuple = ()):
    """--plan PLAN.json, checked to be a plan of MODEL, field by field (planning/plan_check.py): a plan of another
    model (or of another depth of the same family), or one edited by hand, is an error naming the tensor and
    the field, not a placement silently applied with other figures. Options that would also decide the
    placement (the budget options, and the command's own `also`: (flag, value) pairs) are refused beside it."""
    from ..planning.plan_check import check_plan, plan_dtype
    from ..planning.placement import Plan

    given = [opt for opt, v in (("--offload-gb", args.offload_gb), ("--device-memory", args.device_memory),
                                ("--reserve-gb", args.reserve_gb), ("--host-memory", args.host_memory),
                                ("--offload-params", args.offload_params), ("--stats", args.stats),
                                ("--dtype", args.dtype), *also) if v is not None]
    if given or args.policy != "sparse-first":
        raise MoeOffloadError(f"--plan and {', '.join(given) or '--policy'} both decide the placement: give "
                              "--plan alone, or budget options without it")
    plan_path, model_arg = args.plan, args.model
    try:
        plan = Plan.from_json(Path(plan_path).read_text(), source=f"--plan {plan_path}")
    except OSError as exc:
        raise MoeOffloadError(f"cannot read --plan {plan_path}: {exc.strerror}; save one with `moe-offload "
                              "plan MODEL --save PLAN.json`") from exc
    inv, _ = plan_dtype(plan, path)
    check_plan(plan, inv, source=f"--plan {plan_path}", model=str(path),
               fix=f"plan this model with `moe-offload plan {model_arg} --save PLAN.json`")
    return plan


def check_writable(path: Path, option: str) -> None:
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


def write_atomic(path: Path, text: str) -> None:
    """Write a file whole or not at all (a temporary sibling renamed into place)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise MoeOffloadError(f"cannot write {path}: {exc.strerror}; choose a writable path") from exc
