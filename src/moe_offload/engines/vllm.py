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
# FusedMoE's parameters, whatever the family: w13 is gate and up fused, w2 is down. vLLM (0.32) holds them in
# the FusedMoE layer's `routed_experts` submodule (`experts.routed_experts.w13_weight`); SGLang's own FusedMoE
# keeps them on the layer itself (`experts.w13_weight`).
_FUSED_MOE = {"gate_up_proj": "w13_weight", "down_proj": "w2_weight", "gate_up_proj_bias": "w13_bias",
              "down_proj_bias": "w2_bias"}
_ROUTED_HOLDER = {Engine.VLLM: "routed_experts."}
# Modules vLLM's model classes name otherwise than transformers' (vLLM 0.32: GptOssForCausalLM's attention,
# GraniteMoeForCausalLM's router).
_RENAMED = {(Engine.VLLM, "gpt_oss"): (("self_attn.", "attn."),),
            (Engine.VLLM, "granitemoe"): (("block_sparse_moe.router.layer.", "block_sparse_moe.gate."),)}
# The order vLLM's MoE decoder layers register their parameters in (vLLM 0.32, every family it runs here):
# attention, then the MoE block (the router: weight, bias, score-correction bias; the shared expert's gate; the
# shared expert(s); the routed experts), then the layer's own norms, whatever order transformers declares them in
# (Qwen2-MoE and GLM-4 declare the routed experts first, GraniteMoE its norms before the MoE block).
_MOE_ORDER = {"router": 0, "shared_expert_gate": 1, "shared_expert": 2, "routed_expert": 3}
# Attention modules whose parameters vLLM registers in another order than transformers declares them.
_ATTENTION_ORDER = {(Engine.VLLM, "olmoe"): ("qkv_proj", "q_norm", "k_norm", "o_proj")}


def engine_params(plan: Plan, engine: Engine) -> list[Param]:
    """The decoder-layer parameters vLLM/SGLang build for this model, in the order their offloader walks them.

    Names follow the engine's conventions: FusedMoE `w13_weight` / `w2_weight` (`_bias`; under
    `experts.routed_experts.` in vLLM, `experts.` in SGLang), stacked `qkv_proj` / `gate_up_proj` /
    `fused_qkv_a_proj`, the checkpoint's module names (transformers' renamings undone), and the scale parameters
    of FP8 (`weight_scale_inv`) and MXFP4 (`weight_scale`) weights. The order within a layer is transformers'
    declaration order, but for vLLM's MoE blocks (`_MOE_ORDER`). Checked against the parameters vLLM's own
    model classes build: tests/engines/test_vllm.py.
    """
    undo = checkpoint_renamings(plan.model_type)
    holder = _ROUTED_HOLDER.get(engine, "")
    renamed = _RENAMED.get((engine, plan.model_type), ())
    params: dict[tuple[int, str], list] = {}
    for t in plan.tensors:
        prefix = layer_prefix(t.name)
        if t.component != "language" or prefix is None or t.layer is None:
            continue   # only the decoder layer stack goes through the engines' offloader
        name = t.name
        last = name.rpartition(".")[2]
        fused = t.role == "routed_expert" and name.split(".")[-2:-1] == ["experts"] and last in _FUSED_MOE
        if fused:
            name = f"{name.rpartition('.')[0]}.{holder}{_FUSED_MOE[last]}"
        for target, source in undo:
            name = name.replace(target, source)
        for ours, theirs in renamed:
            name = name.replace(f".{ours}", f".{theirs}")
        rel = name[len(layer_prefix(name) or prefix) + 1:].split(".")
        if not fused and len(rel) >= 2 and rel[-2] in _STACKED:
            rel[-2] = _STACKED[rel[-2]]
        names = [".".join(rel)]
        if rel[-1].endswith("weight") and t.dtype.startswith("float8"):
            names.append(names[0] + "_scale_inv")
        elif rel[-1].endswith("weight") and t.dtype == "mxfp4":
            names.append(names[0] + "_scale")
        key = (t.layer, names[0])
        entry = params.setdefault(key, [t.layer, names, [], 0, t.role])
        entry[2].append(t.name)
        entry[3] += t.bytes
    out = [Param(layer, tuple(names), tuple(ts), b) for layer, names, ts, b, _ in params.values()]
    if engine is Engine.VLLM:
        roles = [role for *_, role in params.values()]
        out = _vllm_moe_order(out, roles, _ATTENTION_ORDER.get((engine, plan.model_type), ()))
    return out


def _vllm_moe_order(params: list[Param], roles: list[str], attention: Sequence[str]) -> list[Param]:
    """Each MoE layer's parameters in vLLM's order (`_MOE_ORDER`): the rest as declared (attention modules in
    the order `attention` names, where given), the MoE block, the layer's own norms (`input_layernorm.weight`: a
    norm that is a direct child of the layer)."""
    def module_rank(p: Param) -> int:
        module = p.names[0].split(".")[-2] if "." in p.names[0] else ""
        return attention.index(module) if module in attention else -1

    def rank(p: Param, role: str) -> int | None:
        if "shared_expert_gate" in p.names[0].split("."):
            return _MOE_ORDER["shared_expert_gate"]
        return _MOE_ORDER.get(role)

    out: list[Param] = []
    layers: dict[int, list[tuple[Param, str]]] = {}
    for p, role in zip(params, roles):
        layers.setdefault(p.layer, []).append((p, role))
    for members in layers.values():
        if not any(rank(p, r) == _MOE_ORDER["routed_expert"] for p, r in members):
            out += [p for p, _ in members]   # a dense layer: as declared
            continue
        block = sorted((rank(p, r), i, p) for i, (p, r) in enumerate(members) if rank(p, r) is not None)
        norms = [p for p, r in members if r == "norm" and len(p.names[0].split(".")) == 2]
        rest = [p for p, r in members if rank(p, r) is None and p not in norms]
        if attention:
            ranked = iter(sorted((p for p in rest if module_rank(p) >= 0), key=module_rank))
            rest = [next(ranked) if module_rank(p) >= 0 else p for p in rest]
        out += rest + [p for _, _, p in block] + norms
    return out


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
    params = engine_params(plan, engine)
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
