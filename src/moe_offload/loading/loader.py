"""Loading a Hugging Face checkpoint straight into its plan: `load`, the orchestration.

The model is built with its parameters on the meta device (buffers are computed as usual,
they are small). The plan, made here or given, is checked against the model (planning/plan_check.py).
Its tensors are then allocated in their tiers (allocate.py: device tensors on the device, host
tensors in exact-size host slabs, one per layer) and the checkpoint is streamed into them
(stream.py: each checkpoint tensor read once from its shard and written once into its slot, per-expert
checkpoint tensors straight into their slice of the fused in-memory tensor). The whole model never
sits on the device, and no second full copy is made in host memory. Any error leaves nothing behind:
the half-built model is dropped, not returned.

Quantized checkpoints (FP8 block-scaled, MXFP4) are written as stored: each quantized tensor is
its values and its scales (quant_weights.py), both in the tensor's planned tier, never
dequantized on the way; the runtime dequantizes them on the compute device at use.
"""

from __future__ import annotations

import sys

import contextlib
import dataclasses
from pathlib import Path

import torch
import torch.nn as nn

from ..run.device_cache import DeviceCache, cache_options, check_capacity, reserve_note
from ..run.disk_tier import DiskTier, placeholder as disk_placeholder
from ..errors import CheckpointError, ConfigError, DeviceError, MoeOffloadError, SelectorError
from ..model.checkpoint import read_headers, safetensors_files
from ..model.config import DTYPE_NAMES, build_meta_model, read_config
from ..model.inventory import from_checkpoint
from ..formats.layouts import map_keys
from ..planning.planner import plan as make_plan
from ..planning.placement import Plan, Tier
from ..planning.plan_check import check_plan, plan_dtype
from ..formats.quant import spec_from_config
from ..run.quant_weights import checkpoint_owner, quant_layouts
from ..storage.host import HostArena, resolve_device, set_tensor
from .handle import Loaded
from .allocate import allocate
from .stream import stream_checkpoint
from ..run.runtime import set_runtime


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


def load(model_dir, *, device=None, backend: str | None = None, plan: Plan | str | Path | None = None,
         dtype: str | None = None, progress: bool = False, cache_gb: float | None = None,
         cache_policy: str | None = None, experts: str | None = None, host_cache_gb: float | None = None,
         lookahead: int = 0, lookahead_from: str = "output", disk_read: str = "direct",
         expert_compute: str = "auto", link_gbps: float | None = None, host_gbps: float | None = None,
         host_gflops: float | None = None, measure_host: bool = False, **budget):
    """Build, load and attach a runtime. Returns (model, plan).

    `budget`: offload_gb, device_memory_gb, reserve_gb, policy, offload_params, batch (as `moe_offload.plan`).
    `plan`: a Plan (or its JSON file) to apply instead of planning here.
    `cache_gb`: a device-side cache of that many GiB for offloaded routed experts (device_cache.py), under
    `cache_policy` (cache_policy.py; default its DEFAULT_CACHE_POLICY); 0 or None is no cache.
    `host_cache_gb`: a host-memory cache of that many GiB for disk-tier routed experts (host_cache.py), under the
    same `cache_policy`, carved out of host_memory_gb (or, CPU-only, out of reserve_gb).
    `lookahead`: N > 0 starts reading the offloaded experts (disk tier and host tier) layer l + N is predicted to
    pick while layer l runs (run/lookahead.py); 0 is off. `lookahead_from`: the hidden state guesses are made from,
    "output" (layer l's) or "attention" (layer l's residual after attention, before its MoE).
    `disk_read`: how the disk tier reads the checkpoint: "direct" (O_DIRECT, no page cache) or "mmap" (through a
    memory map, the page cache deciding what stays: llama.cpp's way, storage/mapped.py).
    `experts`: how selected experts are computed, "eager" (the class's loop, default), "grouped" (run/grouped.py),
    "fused" (moe-offload's CPU kernels on the stored format, run/fused.py) or "auto" (fused where the kernels run,
    else eager, saying why; the command line's default).
    `expert_compute`: where offloaded experts are computed, "auto" (per layer step by the cost model,
    planning/cost_model.py, where there is a link), "host" or "device" (run/host_compute.py); `link_gbps`,
    `host_gbps`, `host_gflops`: the cost model's rates, measured when not given (the link on CUDA only; the host once
    per machine, cached, again with `measure_host`).
    """
    from ..run.auditor import audit
    from ..run.compute import ExpertsCompute, ExpertsMode, resolve_experts
    from ..run.decode_attention import use_decode_attention
    from ..run.dense_kernel import kernel_linears
    from ..run.experts import is_experts_module
    from ..run.grouped import check_kernels
    from ..run.host_cache import HostCache, carve, host_cache_bytes
    from ..run.host_compute import compute_options, host_compute_for
    from ..storage.process_memory import planned_runtime_bytes, return_freed_buffers
    from ..run.lookahead import SOURCES, Lookahead
    from ..storage.mapped import MODES
    from ..errors import AuditError
    from ..run.runtime import BACKENDS, Runtime, backend_named
    from ..run.transformers_compat import check_version as check_transformers

    check_transformers()
    folder = Path(model_dir)
    if not folder.is_dir():
        raise ConfigError(f"{folder} is not a model folder: give a local folder with config.json and safetensors")
    dev = resolve_device(device)
    if dev.type == "cpu":   # RAM is the device: freed buffers go back to the system (process_memory.py)
        return_freed_buffers()
    mode, why_not_fused = resolve_experts(experts, dev)
    if mode is ExpertsMode.GROUPED:
        check_kernels(dev)
    experts = ExpertsCompute(mode, why_not_fused)
    backend = backend or "uva"
    if backend not in BACKENDS:
        raise DeviceError(f"unknown backend {backend!r}: use uva or prefetch")
    if dtype is not None and dtype not in DTYPE_NAMES:
        raise ConfigError(f"unknown dtype {dtype!r}: use bf16, fp16 or fp32")
    host_cache = host_cache_bytes(host_cache_gb)
    if host_cache_gb is not None:   # --cache-policy names the policy of both levels
        _, host_policy = cache_options(0, cache_policy)
        cache_bytes, cache_policy = cache_options(cache_gb, cache_policy if cache_gb is not None else None)
        cache_policy = host_policy if cache_gb is None else cache_policy
    else:
        cache_bytes, cache_policy = cache_options(cache_gb, cache_policy)
    # CPU-only, the reserve holds the process itself (measured): the host cache must fit beside it, as the plan must
    process = planned_runtime_bytes(bool(budget.get("cpu_only")), budget.get("device_memory_gb")) if plan is None else 0
    budget, host_note = carve(host_cache, budget, planned=plan is not None, beside=cache_bytes, process=process)
    if disk_read not in MODES:
        raise MoeOffloadError(f"disk_read={disk_read!r}: use {' or '.join(MODES)}")
    if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 0:
        raise MoeOffloadError(f"lookahead={lookahead!r}: give a whole number of layers ahead, 0 for off")
    if lookahead_from not in SOURCES:
        raise MoeOffloadError(f"lookahead_from={lookahead_from!r}: use {' or '.join(SOURCES)}")
    compute_options(expert_compute, link_gbps, host_gbps, host_gflops)

    source = "the plan"
    if isinstance(plan, (str, Path)):
        source = f"plan {plan}"
        plan = Plan.from_json(Path(plan).read_text(), source=source)
    if plan is not None and dtype is None:
        dtype = plan_dtype(plan, folder)[1]   # a plan of `plan --dtype D` loads in D
    config = read_config(folder)
    spec = spec_from_config(config)   # None when unquantized; CheckpointError for a method it cannot read
    storage_dtype = getattr(torch, DTYPE_NAMES[dtype]) if dtype else None
    with _parameters_on_meta():
        model = build_meta_model(config, storage_dtype, device="cpu")
    if mode is ExpertsMode.FUSED:   # the dense Linears' decode calls by the same kernels (dense_kernel.py)
        kernel_linears(model, lambda name, module: is_experts_module(module))
        use_decode_attention(model)  # a decode step's SDPA as a product per kv head (decode_attention.py)
    model.eval()
    inv = from_checkpoint(folder, dtype=dtype, model=model, config=config)
    if plan is None:
        plan = make_plan(inv, **budget, runtime_bytes=process)
    elif any(v is not None for v in budget.values()):
        raise SelectorError("give either a plan or budget options, not both")
    else:
        check_plan(plan, inv, source=source, model=str(folder))
    check_capacity(cache_bytes, plan)
    note = reserve_note(cache_bytes, cache_policy, budget.get("device_memory_gb"), budget.get("reserve_gb"), process)
    for n in (note, host_note):
        if n:
            plan = dataclasses.replace(plan, notes=(*plan.notes, n))
    by_name = {t.name: t for t in plan.tensors}
    # Quantized tensors (FP8, MXFP4) are held as stored: values as the parameter, scales as a buffer beside it
    # in the same tier (quant_weights.py). Checked here, before any memory is taken.
    headers = read_headers(safetensors_files(folder))
    slots = map_keys(model, sorted({checkpoint_owner(k, spec)[0] for k in headers}), known=set(by_name))
    quant = quant_layouts(model, spec, headers, slots, {t.name: t.shape for t in plan.tensors}) if spec else {}
    arena = HostArena(dev, want_uva=backend_named(backend).wants_views)
    disk = None
    try:
        # Disk-tier tensors are not read here: the runtime reads them from these files (disk_tier.py).
        disk = DiskTier.build(folder, plan, slots, dev, quant, inv.tied, disk_read=disk_read)
        targets, splits = allocate(model, plan, dev, arena, quant)
        stream_checkpoint(folder, model, targets, splits, by_name, progress, spec, slots, quant,
                          disk=set(disk.tensors) if disk is not None else set())
        for name, (host_t, visible) in targets.items():
            set_tensor(model, name, visible, is_buffer=by_name[name].is_buffer if name in by_name else True)
        for name, src in (disk.tensors.items() if disk is not None else ()):
            # a split: its disk stack; a quantized tensor: its values (the parameter) and scales (a buffer) as stored
            shape = (len(splits[name].host_ids), *src.shape[1:]) if name in splits else src.shape
            buffer = by_name[name].is_buffer if name in by_name else True
            set_tensor(model, name, disk_placeholder(shape, src.dtype), is_buffer=buffer)
        for alias, target in inv.tied:
            set_tensor(model, alias, model.get_parameter(target))  # the same Parameter: still tied
        _move_buffers(model, dev, set(targets), set(disk.tensors) if disk is not None else set())
        host_names = {t.name: t.tier for t in plan.tensors if t.tier == Tier.HOST}
        host_names.update({q.scale_name: host_names[n] for n, q in quant.items() if n in host_names})
        host_tensors = {name: targets[name][0] for name in host_names if name in targets}
        runtime = Runtime(model, device=dev, backend=backend, arena=arena, host_names=host_names,
                          host_tensors=host_tensors, plan=plan, splits=splits,
                          cache=DeviceCache(cache_policy, cache_bytes) if cache_bytes else None, quant=quant,
                          disk=disk, experts=experts,
                          host_cache=HostCache(cache_policy, host_cache) if host_cache else None,
                          lookahead=Lookahead(lookahead, source=lookahead_from) if lookahead and _offloads_experts(plan)
                          else None,
                          host_compute=host_compute_for(expert_compute, dev, arena,
                                                        offloads_experts=_offloads_experts(plan), link_gbps=link_gbps,
                                                        host_gbps=host_gbps, host_gflops=host_gflops,
                                                        measure_again=measure_host,
                                                        progress=_tell))
        runtime.attach()
        set_runtime(model, runtime)
        mismatches = audit(model, plan)
        if mismatches:
            raise AuditError(mismatches)
        _load_generation_config(model, folder)
    except BaseException:
        arena.release()
        if disk is not None:
            disk.close()
        raise
    return Loaded(model, plan)


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


def _tell(line: str) -> None:
    """One-time measurements and builds say so on stderr (stdout may carry --json)."""
    print(line, file=sys.stderr, flush=True)


def _offloads_experts(plan: Plan) -> bool:
    """Some routed expert is on the host or disk tier: a look-ahead has something to read ahead."""
    return any(t.role == "routed_expert" and t.tier != Tier.DEVICE for t in plan.tensors)
