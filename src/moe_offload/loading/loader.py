"""Loading a Hugging Face checkpoint straight into its plan.

The model is built with its parameters on the meta device (buffers are computed as usual,
they are small). Device-tier tensors are allocated on the device, host-tier tensors in
exact-size host slabs, one per layer. Each checkpoint tensor is then read from its
memory-mapped shard, one tensor (or expert slice) at a time, and written once into its
slot: per-expert checkpoint tensors go straight into their slice of the fused in-memory
tensor. The whole model never sits on the device, and no second full copy is made in host
memory. Any error leaves nothing behind: the half-built model is dropped, not returned.

Quantized checkpoints (FP8 block-scaled, MXFP4) are written as stored: each quantized tensor is
its values and its scales (quant_weights.py), both in the tensor's planned tier, never
dequantized on the way; the runtime dequantizes them on the compute device at use.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn as nn

from ..run.device_cache import DeviceCache, cache_options, check_capacity, reserve_note
from ..storage.disk import SafetensorsReader
from ..run.disk_tier import DiskTier, placeholder as disk_placeholder
from ..errors import CheckpointError, ConfigError, DeviceError, MoeOffloadError, PlanMismatchError, SelectorError
from ..model.inventory import (DTYPE_NAMES, build_meta_model, from_checkpoint, read_config, read_headers,
                        safetensors_files)
from ..formats.layouts import map_keys
from ..planning.planner import Plan, Tier, plan as make_plan
from ..formats.quant import spec_from_config
from ..run.quant_weights import checkpoint_owner, quant_layouts
from ..storage.host import ExpertSplit, HostArena, expert_runs, resolve_device, set_tensor

# O_DIRECT bounce buffer of the loader's reads: large sequential reads, freed when each file is done.
_LOAD_BOUNCE = 16 << 20


@contextlib.contextmanager
def _parameters_on_meta():
    """Build modules with parameters on meta but real buffers (rotary tables and the like).

    Scoped to construction: `register_parameter` is restored on exit, whatever happens.
    """
    original = nn.Module.register_parameter

    def register(module, name, param):
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def _progress(enabled: bool):
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)
    from rich.console import Console

    return Progress(TextColumn("loading"), BarColumn(), DownloadColumn(binary_units=True), TransferSpeedColumn(),
                    TimeRemainingColumn(), console=Console(stderr=True), disable=not enabled, transient=True)


def load(model_dir, *, device=None, backend: str | None = None, plan: Plan | str | Path | None = None,
         dtype: str | None = None, progress: bool = False, cache_gb: float | None = None,
         cache_policy: str | None = None, **budget):
    """Build, load and attach a runtime. Returns (model, plan).

    `budget`: offload_gb, device_memory_gb, reserve_gb, policy, offload_params, batch (as `moe_offload.plan`).
    `plan`: a Plan (or its JSON file) to apply instead of planning here.
    `cache_gb`: a device-side cache of that many GiB for offloaded routed experts (device_cache.py), under
    `cache_policy` (cache_policy.py; default its DEFAULT_CACHE_POLICY); 0 or None is no cache.
    """
    from ..run.auditor import audit
    from ..errors import AuditError
    from ..run.runtime import BACKENDS, Runtime

    folder = Path(model_dir)
    if not folder.is_dir():
        raise ConfigError(f"{folder} is not a model folder: give a local folder with config.json and safetensors")
    dev = resolve_device(device)
    backend = backend or "uva"
    if backend not in BACKENDS:
        raise DeviceError(f"unknown backend {backend!r}: use uva or prefetch")
    if dtype is not None and dtype not in DTYPE_NAMES:
        raise ConfigError(f"unknown dtype {dtype!r}: use bf16, fp16 or fp32")
    cache_bytes, cache_policy = cache_options(cache_gb, cache_policy)

    config = read_config(folder)
    spec = spec_from_config(config)   # None when unquantized; CheckpointError for a method it cannot read
    storage_dtype = getattr(torch, DTYPE_NAMES[dtype]) if dtype else None
    with _parameters_on_meta():
        model = build_meta_model(config, storage_dtype, device="cpu")
    model.eval()
    inv = from_checkpoint(folder, dtype=dtype, model=model, config=config)
    if isinstance(plan, (str, Path)):
        plan = Plan.from_json(Path(plan).read_text())
    if plan is None:
        plan = make_plan(inv, **budget)
    elif any(v is not None for v in budget.values()):
        raise SelectorError("give either a plan or budget options, not both")
    _check_plan_matches(plan, inv, folder)
    check_capacity(cache_bytes, plan)
    note = reserve_note(cache_bytes, cache_policy, budget.get("device_memory_gb"), budget.get("reserve_gb"))
    if note:
        plan = dataclasses.replace(plan, notes=(*plan.notes, note))
    on_disk = sum(t.offloaded_bytes for t in plan.tensors if t.tier == Tier.DISK and t.role == "routed_expert")
    if cache_bytes and on_disk:
        plan = dataclasses.replace(plan, notes=(*plan.notes, (
            f"the device cache holds host-tier experts only: the {on_disk} bytes of routed experts on the disk tier "
            "are read from the checkpoint at every use (counted as disk reads)")))

    by_name = {t.name: t for t in plan.tensors}
    # Quantized tensors (FP8, MXFP4) are held as stored: values as the parameter, scales as a buffer beside it
    # in the same tier (quant_weights.py). Checked here, before any memory is taken.
    headers = read_headers(safetensors_files(folder))
    slots = map_keys(model, sorted({checkpoint_owner(k, spec)[0] for k in headers}), known=set(by_name))
    quant = quant_layouts(model, spec, headers, slots, {t.name: t.shape for t in plan.tensors}) if spec else {}
    arena = HostArena(dev, want_uva=(backend == "uva"))
    disk = None
    try:
        # Disk-tier tensors are not read here: the runtime reads them from these files (disk_tier.py).
        disk = DiskTier.build(folder, plan, slots, dev, quant, inv.tied)
        targets, splits = _allocate(model, plan, dev, arena, quant)
        _stream_checkpoint(folder, model, targets, splits, by_name, progress, spec, slots, quant,
                           disk=set(disk.tensors) if disk is not None else set())
        for name, (host_t, visible) in targets.items():
            set_tensor(model, name, visible, is_buffer=by_name[name].is_buffer if name in by_name else True)
        for name in (disk.tensors if disk is not None else ()):
            t = by_name[name]
            shape = (len(t.host_ids), *t.shape[1:]) if name in splits else t.shape  # a split: its disk stack
            set_tensor(model, name, disk_placeholder(shape, disk.tensors[name].dtype), is_buffer=t.is_buffer)
        for alias, target in inv.tied:
            set_tensor(model, alias, model.get_parameter(target))  # the same Parameter: still tied
        _move_buffers(model, dev, set(targets), set(disk.tensors) if disk is not None else set())
        host_names = {t.name: t.tier for t in plan.tensors if t.tier == Tier.HOST}
        host_names.update({q.scale_name: host_names[n] for n, q in quant.items() if n in host_names})
        host_tensors = {name: targets[name][0] for name in host_names if name in targets}
        runtime = Runtime(model, device=dev, backend=backend, arena=arena, host_names=host_names,
                          host_tensors=host_tensors, plan=plan, splits=splits,
                          cache=DeviceCache(cache_policy, cache_bytes) if cache_bytes else None, quant=quant,
                          disk=disk)
        runtime.attach()
        model.moe_offload_runtime = runtime
        mismatches = audit(model, plan)
        if mismatches:
            raise AuditError(mismatches)
        _load_generation_config(model, folder)
    except BaseException:
        arena.release()
        if disk is not None:
            disk.close()
        raise
    return model, plan


def load_tokenizer(folder: Path):
    """The model folder's own tokenizer; a folder without tokenizer files is refused (transformers would
    otherwise build an empty one from the config)."""
    from transformers import AutoTokenizer

    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((Path(folder) / f).is_file() for f in files):
        raise MoeOffloadError(f"{folder} has no tokenizer (none of {', '.join(files)}); generate and bench need "
                              "the tokenizer files save_pretrained writes next to the weights")
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise MoeOffloadError(f"{folder} has no usable tokenizer ({type(exc).__name__}); the folder needs "
                              "tokenizer.json / tokenizer_config.json as save_pretrained writes them") from exc


def _check_plan_matches(plan: Plan, inv, folder: Path) -> None:
    planned = {t.name: t for t in plan.tensors}
    actual = {r.name: r for r in inv.records}
    if planned.keys() != actual.keys():
        only_plan = sorted(planned.keys() - actual.keys())[:3]
        only_model = sorted(actual.keys() - planned.keys())[:3]
        raise PlanMismatchError(f"the plan is for another model than {folder}: plan-only tensors {only_plan}, "
                              f"model-only tensors {only_model}; plan this model again")
    for name, t in planned.items():
        if tuple(t.shape) != actual[name].shape or t.dtype != actual[name].dtype:
            raise PlanMismatchError(f"the plan gives {name} shape {list(t.shape)}, {t.dtype}, but {folder} loads "
                                    f"it as {list(actual[name].shape)}, {actual[name].dtype}; plan this model "
                                    "again (with the same dtype)")
        split_ids(t, actual[name].module_class)


def split_ids(t, module_class: str) -> tuple[int, ...] | None:
    """The host experts of a tensor the plan splits between tiers (ascending), or None for a whole tensor.

    Any subset of a fused routed-expert tensor's experts may be on the host (`host_expert_ids`; legacy plans
    give only the count `host_experts`: its last experts). All of them is the whole tensor on the host.
    Anything else is refused: a wrong plan would put experts in the wrong stack or count bytes wrongly.
    """
    if not t.host_experts and not t.host_expert_ids:
        return None
    what = (f"the plan offloads experts {list(t.host_expert_ids) or t.host_experts} of {t.name} ({t.role}, shape "
            f"{list(t.shape)}, tier {t.tier})")
    if not (t.tier in (Tier.HOST, Tier.DISK) and t.role == "routed_expert" and len(t.shape) >= 2
            and "Experts" in module_class):
        raise MoeOffloadError(f"{what}: only a fused routed-expert tensor on the host can go in part (by expert), "
                              "or one on the disk tier (its listed experts read from the checkpoint); plan this "
                              "model again")
    experts = t.shape[0]
    if not t.host_expert_ids:
        if not 0 < t.host_experts <= experts:
            raise MoeOffloadError(f"{what}: a fused routed-expert tensor can go in part only with 0 < host_experts "
                                  f"<= its {experts} experts; plan this model again")
        return None if t.host_experts == experts else t.host_ids
    ids = tuple(t.host_expert_ids)
    bad = [e for e in ids if not (isinstance(e, int) and 0 <= e < experts)]
    if bad:
        raise PlanMismatchError(f"{what}: expert id(s) {bad[:5]} are out of range, the tensor has experts "
                                f"0..{experts - 1}; the plan is for another model: plan this model again")
    if len(set(ids)) != len(ids):
        dup = sorted({e for e in ids if ids.count(e) > 1})
        raise MoeOffloadError(f"{what}: expert id(s) {dup[:5]} are listed more than once; host_expert_ids must be "
                              "distinct: plan this model again")
    if list(ids) != sorted(ids):
        raise MoeOffloadError(f"{what}: host_expert_ids are not sorted; they must be ascending: plan this model again")
    if t.host_experts != len(ids):
        raise MoeOffloadError(f"{what}: host_experts says {t.host_experts} experts but host_expert_ids lists "
                              f"{len(ids)}; the plan was edited inconsistently: plan this model again")
    return None if len(ids) == experts else ids


def _allocate(model: nn.Module, plan: Plan, dev: torch.device, arena: HostArena, quant=None):
    """(name -> (host tensor or device tensor, tensor the model holds), split tensors' layouts).

    Host tensors live in per-layer slabs. A routed-expert tensor split between tiers holds its host experts
    as the rows of a slab tensor (the host stack: the tensor the model holds) and its other experts in a
    device tensor (the resident stack): name -> ExpertSplit. A quantized tensor (`quant`: name -> QuantLayout)
    is two tensors as stored, its values and its scales, placed alike: the same tier, slab and split.
    """
    quant = quant or {}
    meta = {**dict(model.named_parameters()), **{n: b for n, b in model.named_buffers()}}
    module_class = {name: type(model.get_submodule(name.rpartition(".")[0])).__name__ for name in meta}
    targets: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    splits: dict[str, ExpertSplit] = {}
    regions: dict[str, list] = defaultdict(list)
    for t in plan.tensors:
        m = meta[t.name]
        q = quant.get(t.name)
        stored = [(t.name, tuple(t.shape), m.dtype)] if q is None else \
            [(t.name, q.data_shape, q.data_dtype), (q.scale_name, q.scale_shape, q.scale_dtype)]
        ids = split_ids(t, module_class[t.name])
        region = f"{t.component}:" + (f"layer {t.layer}" if t.layer is not None else "other")
        for name, shape, tdtype in stored:
            if ids is not None:
                experts = t.shape[0]
                resident = torch.empty((experts - len(ids), *shape[1:]), dtype=tdtype, device=dev)
                splits[name] = ExpertSplit(resident, ids, experts)
                if t.tier == Tier.HOST:   # a disk-tier split: its other experts stay in the checkpoint
                    regions[region].append((name, (len(ids), *shape[1:]), tdtype))
            elif t.tier == Tier.DISK:
                continue
            elif t.tier == Tier.DEVICE:
                x = torch.empty(shape, dtype=tdtype, device=dev)
                if m.device.type != "meta":  # a buffer computed at construction: kept unless the checkpoint has one
                    x.copy_(m)
                targets[name] = (x, x)
            else:
                regions[region].append((name, shape, tdtype))
    for region, specs in regions.items():
        targets.update(arena.allocate(region, specs))
    for name, (host, _) in targets.items():
        m = meta.get(name)
        if m is not None and m.device.type != "meta" and arena.owns(host):
            host.copy_(m)
    return targets, splits


def _stream_checkpoint(folder: Path, model: nn.Module, targets, splits, by_name, progress: bool, spec=None,
                       slots=None, quant=None, disk: set[str] = frozenset()) -> None:
    """Write every checkpoint tensor once into its place. `slots`: owner key -> Slot (quant_weights.
    checkpoint_owner); a quantized tensor's values and scales land in its two stored tensors (`quant`).
    Tensors in `disk` are not read (a disk-tier split tensor: only its resident experts).

    Files are read through disk.SafetensorsReader (O_DIRECT, or buffered reads whose pages are released after
    each read), in file order, straight into the destination when it is contiguous and needs no conversion:
    a memory-mapped shard would keep every page it touched resident while the model fills up (peak RSS about
    twice the checkpoint)."""
    quant = quant or {}
    files = safetensors_files(folder)
    if slots is None:
        slots = map_keys(model, read_headers(files).keys(), known=set(by_name))
    written: dict[str, int] = defaultdict(int)
    with _progress(progress) as bar:
        task = bar.add_task("load", total=sum(t.bytes for t in by_name.values()))
        for path in files:
            with SafetensorsReader(path, bounce_bytes=_LOAD_BOUNCE) as reader:
                for span in sorted(reader.tensors.values(), key=lambda sp: sp.start):
                    key = span.name
                    owner, is_scale = checkpoint_owner(key, spec)
                    slot = slots[owner]
                    q = quant.get(slot.target)
                    target = q.scale_name if (q is not None and is_scale) else slot.target
                    if target in disk and target not in splits:
                        continue                      # read at run time from this file (disk_tier.py)
                    if target not in targets and target not in splits:
                        raise CheckpointError(f"{path.name}: tensor {key!r} matches no tensor of the model; "
                                              "the checkpoint and config.json are for different models")
                    host = targets[target][0] if target in targets else None   # None: a disk-tier split
                    split = splits.get(target)
                    if split is not None and host is None and slot.expert is not None \
                            and slot.expert < split.num_experts \
                            and split.where(slot.expert)[0] == Tier.HOST.value:   # (out of range: refused below)
                        continue                      # this expert of a disk-tier split stays on disk
                    like = host if host is not None else split.resident
                    full_shape = by_name[target].shape if q is None else (q.scale_shape if is_scale else q.data_shape)
                    shape = tuple(_destination(torch.empty(full_shape, device="meta"), slot, key).shape)
                    stored = tuple(span.shape)
                    # transformers' Transpose(check_dims=True): transpose only when the tensor does not already fit.
                    transpose = slot.transpose is not None and not (getattr(slot, "transpose_if_needed", False)
                                                                    and stored == shape)
                    if transpose:
                        a, b = slot.transpose
                        stored = list(stored)
                        stored[a], stored[b] = stored[b], stored[a]
                        stored = tuple(stored)
                    if stored != shape:
                        raise CheckpointError(
                            f"{path.name}: {key!r} has shape {list(stored)}, but its place in "
                            f"{target} has shape {list(shape)}; the checkpoint does not match config.json")
                    if span.dtype.is_floating_point != like.is_floating_point():
                        raise CheckpointError(f"{path.name}: {key!r} is {span.dtype}, the model expects {like.dtype}; "
                                              "the checkpoint does not match config.json")
                    if q is not None and span.dtype != like.dtype:   # stored bytes are copied, never converted
                        raise CheckpointError(f"{path.name}: {key!r} is {span.dtype}, but {target} is held as "
                                              f"stored in {like.dtype} (the checkpoint's other parts of it); "
                                              "a tensor must be quantized whole: the checkpoint is inconsistent")
                    dst = (_destination(host, slot, key) if host.dim() else host) \
                        if split is None and not transpose else None
                    if dst is not None and dst.device.type == "cpu" and dst.is_contiguous() \
                            and dst.dtype == span.dtype:
                        reader.read(key, out=dst)     # straight into its place: no temporary
                    else:
                        src = reader.read(key)
                        if transpose:
                            src = src.transpose(*slot.transpose)
                        _write(host, split, slot, src, key)
                    numel = math.prod(span.shape)
                    written[target] += numel
                    bar.advance(task, numel * like.element_size())
    missing = [n for n, (host, _) in targets.items()
               if written.get(n, 0) != host.numel() + (splits[n].resident.numel() if n in splits else 0)
               and not (n in by_name and by_name[n].is_buffer)]
    missing += [n for n, sp in splits.items() if n not in targets and written.get(n, 0) != sp.resident.numel()]
    if missing:
        raise CheckpointError(f"{folder}: {len(missing)} tensor(s) not fully written by the checkpoint "
                              f"(first: {missing[:3]}); the checkpoint is incomplete")


def _write(host: torch.Tensor, split: ExpertSplit | None, slot, src: torch.Tensor, key: str) -> None:
    """Copy `src` once into its place: the target `host` (the tensor in its tier), or for a tensor split
    between tiers, each expert's row of the stack that holds it (split.where)."""
    if split is None:
        (_destination(host, slot, key) if host.dim() else host).copy_(src)
    elif slot.expert is None:   # one checkpoint tensor spans every expert: each stack takes its experts' rows
        if slot.parts > 1 and slot.part_dim == 0:
            raise CheckpointError(f"checkpoint tensor {key!r} is concatenated along the experts dim of "
                                  f"{slot.target}, which the plan splits by expert; offload it whole instead")
        for stack, ids in ((split.resident, split.resident_ids), (host, split.host_ids)):
            if stack is None:   # a disk-tier split: its disk experts stay in the checkpoint
                continue
            dst = _destination(stack, slot, key)
            for row, first, count in expert_runs(ids):
                dst[row:row + count].copy_(src[first:first + count])
    else:                       # one checkpoint tensor per expert (range checked against the full shape)
        tier, row = split.where(slot.expert)
        stack = host if tier == Tier.HOST else split.resident
        _destination(stack, dataclasses.replace(slot, expert=row), key).copy_(src)


def _destination(host: torch.Tensor, slot, key: str) -> torch.Tensor:
    dst = host
    if slot.expert is not None:
        if slot.expert >= dst.shape[0]:
            raise CheckpointError(f"checkpoint tensor {key!r} is expert {slot.expert}, but {slot.target} holds "
                                  f"{dst.shape[0]} experts; the checkpoint does not match config.json")
        dst = dst[slot.expert]
    if slot.parts > 1:
        size = dst.shape[slot.part_dim] // slot.parts
        dst = dst.narrow(slot.part_dim, slot.part * size, size)
    return dst


def _move_buffers(model: nn.Module, dev: torch.device, placed: set[str], on_disk: set[str] = frozenset()) -> None:
    """Non-persistent buffers (rotary tables) were computed on the CPU at construction: move them.

    Buffers in `placed` are already in their planned tier (an offloaded one stays on the host)."""
    for name, buf in list(model.named_buffers()):
        if name not in placed and name not in on_disk and buf.device != dev and buf.device.type != "meta":
            set_tensor(model, name, buf.to(dev), is_buffer=True)
    leftover = [n for n, p in model.named_parameters() if p.device.type == "meta" and n not in on_disk]
    if leftover:
        raise CheckpointError(f"{len(leftover)} parameter(s) were not loaded (first: {leftover[:3]})")


def _load_generation_config(model: nn.Module, folder: Path) -> None:
    from transformers import GenerationConfig

    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(folder), local_files_only=True)
