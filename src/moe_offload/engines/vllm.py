"""A plan in vLLM's options, and the walk over decoder layers that vLLM and SGLang share.

vLLM `--cpu-offload-gb X [--cpu-offload-params SEG ...]` (UVAOffloader): walks the decoder layers
that `make_layers` builds, in order, and each layer's parameters in order, offloading those whose
layer-relative name contains a selector as whole dot-separated segments until X GiB
(int(X * 2**30) bytes) are offloaded. Embeddings, the final norm, the LM head and vision towers are
never offered. Offloaded weights are read in place over the link (UVA): a token reads the experts it
picks. SGLang's `--cpu-offload-gb` is the same walk with no selectors (sglang.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..model.inventory import layer_prefix
from ..planning.placement import GiB, Plan, format_bytes
from ..planning.planner import matches_selector
from .checkpoint_names import checkpoint_renamings
from .engine import LABELS, OFFLOADED, Engine

VLLM_READS = ("vLLM reads offloaded weights in place over the link (UVA): a token reads only the experts it "
              "picks; where UVA is unavailable it copies each offloaded layer whole at every forward instead")


def vllm_options(plan: Plan, *, device_memory_gb: float | None = None, reserve_gb: float | None = None,
                 max_position_embeddings: int | None = None) -> tuple[list[str], set[str], list[str]]:
    """vLLM's options for `plan`: (args, the in-memory tensors they send to host memory, notes); with
    `device_memory_gb`, a note on fitting the plan into --gpu-memory-utilization."""
    args, host, notes = layer_walk(plan, Engine.VLLM, selectors_allowed=True, reads=VLLM_READS)
    if device_memory_gb is not None:
        notes.append(_vllm_memory_note(plan, device_memory_gb, reserve_gb, max_position_embeddings))
    return args, host, notes


@dataclass(frozen=True)
class Param:
    """One parameter of an engine's decoder layer: possibly several of our tensors (q, k, v -> qkv_proj)."""

    layer: int
    names: tuple[str, ...]     # layer-relative engine names; quantized weights bring their scale parameters
    tensors: tuple[str, ...]   # our in-memory names
    bytes: int


# vLLM (and SGLang, which shares its layers) stacks these projections into one parameter.
_STACKED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
            "up_proj": "gate_up_proj", "q_a_proj": "fused_qkv_a_proj", "kv_a_proj_with_mqa": "fused_qkv_a_proj"}
# FusedMoE's parameters, whatever the family: w13 is gate and up fused, w2 is down.
_FUSED_MOE = {"gate_up_proj": "w13_weight", "down_proj": "w2_weight", "gate_up_proj_bias": "w13_bias",
              "down_proj_bias": "w2_bias"}


def engine_params(plan: Plan) -> list[Param]:
    """The decoder-layer parameters vLLM/SGLang build for this model, in the order their offloader walks them.

    Names follow vLLM's conventions: FusedMoE `experts.w13_weight` / `w2_weight` (`_bias`), stacked
    `qkv_proj` / `gate_up_proj` / `fused_qkv_a_proj`, the checkpoint's module names (transformers'
    renamings undone), and the scale parameters of FP8 (`weight_scale_inv`) and MXFP4 (`weight_scale`)
    weights. The order within a layer is transformers' declaration order.
    """
    undo = checkpoint_renamings(plan.model_type)
    params: dict[tuple[int, str], list] = {}
    for t in plan.tensors:
        prefix = layer_prefix(t.name)
        if t.component != "language" or prefix is None or t.layer is None:
            continue   # only the decoder layer stack goes through the engines' offloader
        name = t.name
        last = name.rpartition(".")[2]
        fused = t.role == "routed_expert" and name.split(".")[-2:-1] == ["experts"] and last in _FUSED_MOE
        if fused:
            name = f"{name.rpartition('.')[0]}.{_FUSED_MOE[last]}"
        for target, source in undo:
            name = name.replace(target, source)
        rel = name[len(layer_prefix(name) or prefix) + 1:].split(".")
        if not fused and len(rel) >= 2 and rel[-2] in _STACKED:
            rel[-2] = _STACKED[rel[-2]]
        names = [".".join(rel)]
        if rel[-1].endswith("weight") and t.dtype.startswith("float8"):
            names.append(names[0] + "_scale_inv")
        elif rel[-1].endswith("weight") and t.dtype == "mxfp4":
            names.append(names[0] + "_scale")
        key = (t.layer, names[0])
        entry = params.setdefault(key, [t.layer, names, [], 0])
        entry[2].append(t.name)
        entry[3] += t.bytes
    return [Param(layer, tuple(names), tuple(ts), b) for layer, names, ts, b in params.values()]


def walk(params: Sequence[Param], selectors: Sequence[str], budget: int) -> list[Param]:
    """What the offloader takes: parameters in order, those the selectors match (all when none), until
    `budget` bytes are offloaded (it checks before each parameter, so the last one crosses the budget)."""
    out, done = [], 0
    for p in params:
        if done >= budget:
            break
        if selectors and not all(any(matches_selector(n, s) for s in selectors) for n in p.names):
            continue
        out.append(p)
        done += p.bytes
    return out


def gib_value(low: int, high: int) -> str:
    """The shortest decimal X with low < int(X * 2**30) <= high (both engines' conversion), taken well inside
    the range when it can be: the engine's own byte count may differ a little from this one."""
    mid = (low + high) / 2
    for lo, hi in ((low + (high - low) // 4, high - (high - low) // 4), (low, high)):
        for places in range(10):
            text = f"{mid / GiB:.{places}f}"
            if lo < int(float(text) * GiB) <= hi:
                return text
    return repr(high / GiB)


def _selectors(params: Sequence[Param], host: set[int]) -> list[str]:
    """Fewest segment selectors that match the names of the host parameters and of no other one."""
    names_all = {n for p in params for n in p.names}
    wanted = {n for i in host for n in params[i].names}
    candidates = set()
    for n in wanted:
        segs = n.split(".")
        for a in range(len(segs)):
            for b in range(a + 1, len(segs) + 1):
                if b - a == 1 and b == len(segs):
                    continue   # a bare parameter name (`weight`, `w2_weight`) reads badly: name its module too
                candidates.add(".".join(segs[a:b]))
    valid = {c: {n for n in names_all if matches_selector(n, c)} for c in candidates}
    valid = {c: m for c, m in valid.items() if m <= wanted}
    chosen, left = [], set(wanted)
    while left:
        best = max(sorted(valid), key=lambda c: (len(valid[c] & left), -c.count("."), -len(c)), default=None)
        if best is None or not valid[best] & left:
            raise AssertionError(f"no selector for {sorted(left)[:3]}")   # a whole name is always valid
        chosen.append(best)
        left -= valid[best]
    order = {n: i for i, p in enumerate(params) for n in p.names}
    return sorted(chosen, key=lambda c: min(order[n] for n in valid[c]))


def layer_walk(plan: Plan, engine: Engine, *, selectors_allowed: bool, reads: str
               ) -> tuple[list[str], set[str], list[str]]:
    """The walk both engines share: (args, the in-memory tensors they send to host memory, notes).
    `selectors_allowed`: the engine takes --cpu-offload-params (vLLM); `reads`: the note saying how it reads
    what it offloaded."""
    params = engine_params(plan)
    by_tensor = {n: i for i, p in enumerate(params) for n in p.tensors}
    planned = {t.name for t in plan.tensors if t.tier in OFFLOADED}
    host = {by_tensor[n] for n in planned if n in by_tensor}
    target = plan.budget_bytes or plan.offloaded_bytes
    notes: list[str] = []
    selectors: list[str] = []
    if selectors_allowed and target:
        role = {t.name: t.role for t in plan.tensors}
        routed = {i for i, p in enumerate(params) if all(role[n] == "routed_expert" for n in p.tensors)}
        tries = [_selectors(params, host or routed)] if host or routed else []
        if routed - host:
            tries.append(_selectors(params, host | routed))
        tries.append([])
        for selectors in tries:
            if sum(p.bytes for p in walk(params, selectors, target)) >= target:
                break
    taken = walk(params, selectors, target)
    args: list[str] = []
    if taken:
        done = sum(p.bytes for p in taken)
        args = ["--cpu-offload-gb", gib_value(done - taken[-1].bytes, done)]
        if selectors:
            args += ["--cpu-offload-params", *selectors]
        assert walk(params, selectors, int(float(args[1]) * GiB)) == taken   # the value printed gives this walk
    offloaded = sum(p.bytes for p in taken)
    if offloaded < target:
        notes.append(f"{LABELS[engine]} can offload only the decoder layers' parameters ({format_bytes(offloaded)}), "
                     f"less than the {format_bytes(target)} the plan must offload: the model will not fit as planned")
    if taken:
        last = taken[-1]
        notes.append(f"{LABELS[engine]} offloads whole parameters until it has {args[1]} GiB; that falls inside the "
                     f"last one it takes (layer {last.layer} {last.names[0]}), so it stops there, at "
                     f"{format_bytes(offloaded)}, even if its own byte count differs a little from this one's. "
                     "--cpu-offload-gb is per GPU: with --tensor-parallel-size T each rank offloads from its own "
                     f"1/T shard, so give {args[1]}/T for the same placement")
    else:
        notes.append("nothing to offload: no --cpu-offload-gb")
    if taken:
        notes.append(reads)
    quantized = {t.dtype for t in plan.tensors if t.name in planned and (t.dtype == "mxfp4" or "float8" in t.dtype)}
    if quantized:
        pad = " and may pad MXFP4 experts for its kernels" if "mxfp4" in quantized else ""
        notes.append(f"quantized weights: {LABELS[engine]} keeps their scales as separate parameters{pad}, so its "
                     "byte count can differ slightly from this one; its log line 'Total CPU offloaded parameters' "
                     f"should read about {format_bytes(offloaded)}")
    return args, {n for p in taken for n in p.tensors}, notes


def _vllm_memory_note(plan: Plan, device_gb: float, reserve_gb: float | None, max_len: int | None) -> str:
    import math

    from ..planning.planner import DEFAULT_RESERVE_GB

    reserve = DEFAULT_RESERVE_GB if reserve_gb is None else reserve_gb
    weights = plan.resident_bytes / GiB
    need = math.ceil((weights + reserve) / device_gb * 100) / 100
    default = 0.9 * device_gb
    head = (f"--device-memory {device_gb:g}: the plan keeps {weights:.2f} GiB of weights on the GPU and "
            f"{reserve:g} GiB for activations and KV cache; vLLM works within --gpu-memory-utilization x the GPU's "
            f"memory (default 0.9: {default:.2f} GiB) and the plan needs {need:.2f} of it")
    fix = (f", so the default leaves {default - weights:.2f} GiB beside the weights" if need <= 0.9 else
           f": plan with --device-memory {default:.4g} so that the default suffices, or pass "
           f"--gpu-memory-utilization {need:.2f} (which leaves {(1 - need) * device_gb:.2f} GiB outside vLLM for the "
           "CUDA context and other processes)")
    length = f"the model's {max_len}-token context" if max_len else "the model's context length"
    return (head + fix + f". vLLM sizes its KV cache from what is left and refuses to start if {length} does not "
            "fit: then pass --max-model-len no larger than the token count its error reports")
