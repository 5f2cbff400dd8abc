"""A plan in an engine's own options: vLLM, SGLang, llama.cpp (`moe-offload export`).

Each engine places weights by its own rule; the export finds the options under which that rule
gives this plan, or the closest placement it can give, and says what differs. The placement
reported is the one the options really produce: it is derived by applying the engine's rule to
the options exported (never echoed from the plan), and costed by the plan's own accounting
(Plan.link_bytes_per_token), so `link_bytes_per_token` is what the engine will read.

- vLLM `--cpu-offload-gb X [--cpu-offload-params SEG ...]` (UVAOffloader): walks the decoder layers
  that `make_layers` builds, in order, and each layer's parameters in order, offloading those whose
  layer-relative name contains a selector as whole dot-separated segments until X GiB
  (int(X * 2**30) bytes) are offloaded. Embeddings, the final norm, the LM head and vision towers are
  never offered. Offloaded weights are read in place over the link (UVA): a token reads the experts it
  picks.
- SGLang `--cpu-offload-gb X` (OffloaderV1): the same walk with no selectors, and every offloaded
  parameter of a layer is copied to the GPU in full at each forward: a step reads all of its bytes.
- llama.cpp `-ot REGEX=CPU` / `--n-cpu-moe N` over GGUF tensor names (llama_cpp.py); its input
  embedding always stays in host memory. Tensors are whole: an expert tensor cannot be split.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, replace
from enum import Enum
from typing import Sequence

from ..errors import ConfigError
from ..model.inventory import layer_prefix
from ..planning.placement import GiB, Plan, PlannedTensor, Tier, format_bytes
from ..planning.planner import matches_selector

OFFLOADED = (Tier.HOST.value, Tier.DISK.value)


class Engine(str, Enum):
    VLLM = "vllm"
    SGLANG = "sglang"
    LLAMA_CPP = "llama.cpp"


ENGINES = tuple(e.value for e in Engine)
LABELS = {Engine.VLLM: "vLLM", Engine.SGLANG: "SGLang", Engine.LLAMA_CPP: "llama.cpp"}
_LAUNCH = {Engine.VLLM: "vllm serve {model}", Engine.SGLANG: "python -m sglang.launch_server --model-path {model}",
           Engine.LLAMA_CPP: "llama-server -m MODEL.gguf"}


@dataclass(frozen=True)
class Export:
    engine: Engine
    args: tuple[str, ...]
    notes: tuple[str, ...]
    plan: Plan          # what was asked for
    placement: Plan     # what the engine does with `args`

    @property
    def expressible(self) -> bool:
        """The engine places every tensor as the plan does (how it then reads them may still differ: notes)."""
        return all(_offloaded_part(a) == _offloaded_part(b) for a, b in zip(self.plan.tensors, self.placement.tensors))

    @property
    def link_bytes_per_token(self) -> float:
        return self.placement.link_bytes_per_token()

    def command(self, model: str = "MODEL") -> str:
        return " ".join([_LAUNCH[self.engine].format(model=shlex.quote(model)), *map(shlex.quote, self.args)])

    def to_dict(self, model: str = "MODEL") -> dict:
        return {"engine": self.engine.value, "args": list(self.args), "notes": list(self.notes),
                "expressible": self.expressible, "link_bytes_per_token": self.link_bytes_per_token,
                "command": self.command(model), "offloaded_bytes": self.placement.offloaded_bytes,
                "plan_offloaded_bytes": self.plan.offloaded_bytes,
                "plan_link_bytes_per_token": self.plan.link_bytes_per_token()}


def _offloaded_part(t: PlannedTensor) -> tuple:
    return (t.tier, t.host_ids if t.tier in OFFLOADED else ())


def export(plan: Plan, engine: str, *, device_memory_gb: float | None = None, reserve_gb: float | None = None,
           max_position_embeddings: int | None = None) -> Export:
    """The engine's options for `plan` (or for the closest placement it can apply)."""
    try:
        engine_ = Engine(engine)
    except ValueError:
        raise ConfigError(f"unknown engine {engine!r}: use one of {', '.join(ENGINES)}") from None
    args, host, notes = _llama_cpp(plan) if engine_ is Engine.LLAMA_CPP else _layer_walk(plan, engine_)
    placement = _placement(plan, host, engine_)
    if engine_ is Engine.VLLM and device_memory_gb is not None:
        notes.append(_vllm_memory_note(plan, device_memory_gb, reserve_gb, max_position_embeddings))
    notes = _difference_notes(plan, placement, engine_) + notes
    return Export(engine_, tuple(args), tuple(notes), plan, placement)


def _placement(plan: Plan, host: set[str], engine: Engine) -> Plan:
    """The plan's tensors placed as the engine places them: whole tensors, host or device."""
    tensors = []
    for t in plan.tensors:
        off = t.name in host
        t2 = replace(t, tier=Tier.HOST.value if off else Tier.DEVICE.value, host_experts=0, host_expert_ids=(),
                     disk_expert_ids=(),
                     reason=f"{engine.value}: {'offloaded' if off else 'resident'}")
        if engine is Engine.SGLANG and off:
            # SGLang copies an offloaded parameter to the GPU in full at every forward: no expert axis to
            # read in part, so the accounting reads every byte of it per step.
            t2 = replace(t2, experts=None, top_k=None)
        tensors.append(t2)
    return replace(plan, tensors=tuple(tensors), policy=f"{engine.value} export", notes=())


# ---------------------------------------------------------------------------------------
# vLLM and SGLang: the walk over decoder layers


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
    from .llama_cpp import checkpoint_renamings

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


def _layer_walk(plan: Plan, engine: Engine) -> tuple[list[str], set[str], list[str]]:
    params = engine_params(plan)
    by_tensor = {n: i for i, p in enumerate(params) for n in p.tensors}
    planned = {t.name for t in plan.tensors if t.tier in OFFLOADED}
    host = {by_tensor[n] for n in planned if n in by_tensor}
    target = plan.budget_bytes or plan.offloaded_bytes
    notes: list[str] = []
    selectors: list[str] = []
    if engine is Engine.VLLM and target:
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
    if engine is Engine.VLLM and taken:
        notes.append("vLLM reads offloaded weights in place over the link (UVA): a token reads only the experts it "
                     "picks; where UVA is unavailable it copies each offloaded layer whole at every forward instead")
    elif taken:
        notes.append("SGLang's --cpu-offload-gb offloads decoder-layer parameters in declaration order (it has no "
                     "selectors) and copies them to the GPU in full at every forward, so each step reads all "
                     "their bytes, routed experts included")
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


# ---------------------------------------------------------------------------------------
# llama.cpp


def _llama_cpp(plan: Plan) -> tuple[list[str], set[str], list[str]]:
    from . import llama_cpp as lc

    gg = lc.GgufNames(plan.tensors, plan.model_type)
    by_name = {t.name: t for t in plan.tensors}
    planned = {t.name for t in plan.tensors if t.tier in OFFLOADED}
    # llama.cpp builds the input embedding in host memory whatever the options (it never offloads its input
    # layer). A table tied to the output head is the head too: that copy follows -ngl and -ot.
    embed = {n for n, g in gg.of.items() if g and "token_embd.weight" in g.names and by_name[n].role == "embedding"}
    tied = {n for n, g in gg.of.items() if g and "token_embd.weight" in g.names} - embed
    universe = {n: g for n, g in gg.of.items() if by_name[n].component == "language" and n not in embed}
    patterns, unnamed = lc.patterns_for(planned & set(universe), universe, {n: by_name[n].layer for n in universe})
    gguf = {name: g.layouts[0] for name, g in universe.items() if g is not None}
    names = {x for layout in gguf.values() for x in layout}
    chosen = lc.selected(names, patterns)
    args, notes = ["-ngl", lc.ALL_LAYERS], []
    n = max((lc.block_of(x) for x in chosen if lc.block_of(x) is not None), default=-1) + 1
    first_n = lc.selected({x for x in names if lc.block_of(x) is not None and lc.block_of(x) < n}, [lc.FFN_EXPS_REGEX])
    if chosen and chosen == first_n:
        args += ["--n-cpu-moe", str(n)]
        notes.append(f"--n-cpu-moe {n} sends exactly the routed experts of the first {n} layers to the CPU")
    else:
        args += [item for p in patterns for item in ("-ot", f"{p}=CPU")]
    # What those options do, by llama.cpp's rule; a tensor without a GGUF name goes with its block's pattern.
    sent = lc.selected(names, lc.overrides(args))
    host = {name for name, layout in gguf.items() if set(layout) <= sent}
    assert not any(set(layout) & sent for name, layout in gguf.items() if name not in host)   # tensors go whole
    host |= embed | (planned & {n for n, g in universe.items() if g is None}) - unnamed
    towers = {t.name for t in plan.tensors if t.component != "language"}
    if planned & towers:
        # The towers are the separate --mmproj GGUF, which llama.cpp places as one piece.
        args.append("--no-mmproj-offload")
        host |= towers
        if not towers <= planned:
            notes.append("llama.cpp places the vision/audio tower (the --mmproj file) as one piece: all of it goes "
                         "to host memory")
    if embed - planned:
        notes.append("llama.cpp keeps the input embedding (token_embd.weight) in host memory whatever the options; "
                     "a token reads one row of it there")
    if tied - planned:
        notes.append("the output head shares the input embedding's table (tied): llama.cpp keeps it on the GPU as "
                     "planned and reads the input rows from a second copy in host memory")
    if unnamed:
        notes.append(f"{len(unnamed)} offloaded tensors have no GGUF name from llama.cpp's converter "
                     f"({', '.join(sorted(unnamed)[:3])}) and share a layer with resident ones: they stay on the GPU")
    notes.append("MODEL.gguf: the model converted by llama.cpp's convert_hf_to_gguf.py. -ngl 999 puts everything "
                 "else on the GPU (and so turns off --fit); llama.cpp computes with CPU-resident weights on the CPU "
                 "at decode, so the link bytes here are bytes read from host memory")
    return args, host, notes


# ---------------------------------------------------------------------------------------
# What differs


def _difference_notes(plan: Plan, placement: Plan, engine: Engine) -> list[str]:
    kept, moved, whole = [], [], []
    for a, b in zip(plan.tensors, placement.tensors):
        if a.tier in OFFLOADED and b.tier not in OFFLOADED:
            kept.append(a)
        elif a.tier not in OFFLOADED and b.tier in OFFLOADED:
            moved.append(a)
        elif a.tier in OFFLOADED and a.host_ids and b.tier in OFFLOADED:
            whole.append(a)
    disk = [t for t in plan.tensors if t.tier == Tier.DISK.value and t.name not in {k.name for k in kept}]
    if not (kept or moved or whole or disk):
        return []
    out = []
    name = LABELS[engine]
    if whole:
        extra = sum(t.bytes - t.offloaded_bytes for t in whole)
        out.append(f"{name} offloads whole tensors: {_describe(whole)} that the plan splits by expert go "
                   f"whole to host memory ({format_bytes(extra)} more offloaded)")
    if kept:
        out.append(f"{name} keeps on the GPU what the plan offloads: {_describe(kept)}")
    if moved:
        out.append(f"{name} offloads what the plan keeps on the GPU: {_describe(moved)}")
    if disk:
        out.append(f"{name} has no disk tier: {_describe(disk)} planned on disk go to host memory")
    planned, got = plan.link_bytes_per_token(), placement.link_bytes_per_token()
    delta = placement.offloaded_bytes - plan.offloaded_bytes
    memory = ("" if not delta else f", {format_bytes(abs(delta))} {'less' if delta > 0 else 'more'} GPU memory "
              "used than planned")
    out.append(f"cost of the difference: {format_bytes(got)} read over the link per decoded token against the plan's "
               f"{format_bytes(planned)} ({_signed(got - planned)}){memory}")
    return out


def _signed(n: float) -> str:
    return ("+" if n >= 0 else "-") + format_bytes(abs(n))


def _describe(tensors: Sequence[PlannedTensor]) -> str:
    """`model.embed_tokens.weight (1.16 GiB)`, or per role `12 routed_expert tensors of layers 3-8 (4.50 GiB)`."""
    if len(tensors) <= 3:
        return ", ".join(f"{t.name} ({format_bytes(t.bytes)})" for t in tensors)
    parts = []
    for role in dict.fromkeys(t.role for t in tensors):
        group = [t for t in tensors if t.role == role]
        layers = sorted({t.layer for t in group if t.layer is not None})
        span = f" of layer{'s' if len(layers) > 1 else ''} {_spans(layers)}" if layers else ""
        size = format_bytes(sum(t.bytes for t in group))
        parts.append(f"{group[0].name} ({size})" if len(group) == 1 else f"{len(group)} {role} tensors{span} ({size})")
    return ", ".join(parts)


def _spans(numbers: Sequence[int]) -> str:
    out, start = [], 0
    for i in range(1, len(numbers) + 1):
        if i == len(numbers) or numbers[i] != numbers[i - 1] + 1:
            a, b = numbers[start], numbers[i - 1]
            out.append(str(a) if a == b else f"{a}-{b}")
            start = i
    return ", ".join(out)
