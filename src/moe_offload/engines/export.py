"""A plan in an engine's own options: vLLM, SGLang, llama.cpp (`moe-offload export`).

Each engine places weights by its own rule; the export finds the options under which that rule
gives this plan, or the closest placement it can give, and says what differs. The placement
reported is the one the options really produce: it is derived by applying the engine's rule to
the options exported (never echoed from the plan), and costed by the plan's own accounting
(Plan.link_bytes_per_token), so `link_bytes_per_token` is what the engine will read.

- vLLM `--cpu-offload-gb X [--cpu-offload-params SEG ...]` (UVAOffloader; vllm.py): walks the decoder
  layers in order, each layer's parameters in order, until X GiB are offloaded; offloaded weights are
  read in place over the link (UVA): a token reads the experts it picks.
- SGLang `--cpu-offload-gb X` (OffloaderV1; sglang.py): the same walk with no selectors, and every
  offloaded parameter of a layer is copied to the GPU in full at each forward: a step reads all of its bytes.
- llama.cpp `-ot REGEX=CPU` / `--n-cpu-moe N` over GGUF tensor names (llama_cpp.py, gguf_names.py); its
  input embedding always stays in host memory. Tensors are whole: an expert tensor cannot be split.

This module holds the Export result, the dispatch to the engine's module, and the notes on what differs.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, replace
from typing import Sequence

from ..errors import ConfigError
from ..planning.placement import Plan, PlannedTensor, Tier, format_bytes
from .engine import ENGINES, LABELS, OFFLOADED, Engine
from .llama_cpp import cpu_tensors, llama_cpp_options
from .sglang import read_in_full, sglang_options
from .vllm import vllm_options

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
                "plan_link_bytes_per_token": self.plan.link_bytes_per_token(),
                **({"cpu_tensors": sorted(cpu_tensors(self.plan, self.args))} if self.engine is Engine.LLAMA_CPP
                   else {})}


def _offloaded_part(t: PlannedTensor) -> tuple:
    return (t.tier, t.host_ids if t.tier in OFFLOADED else ())


def export(plan: Plan, engine: str, *, device_memory_gb: float | None = None, reserve_gb: float | None = None,
           max_position_embeddings: int | None = None) -> Export:
    """The engine's options for `plan` (or for the closest placement it can apply)."""
    try:
        engine_ = Engine(engine)
    except ValueError:
        raise ConfigError(f"unknown engine {engine!r}: use one of {', '.join(ENGINES)}") from None
    if engine_ is Engine.VLLM:
        args, host, notes = vllm_options(plan, device_memory_gb=device_memory_gb, reserve_gb=reserve_gb,
                                         max_position_embeddings=max_position_embeddings)
    elif engine_ is Engine.SGLANG:
        args, host, notes = sglang_options(plan)
    else:
        args, host, notes = llama_cpp_options(plan)
    placement = _placement(plan, host, engine_)
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
            t2 = read_in_full(t2)
        tensors.append(t2)
    return replace(plan, tensors=tuple(tensors), policy=f"{engine.value} export", notes=())


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
