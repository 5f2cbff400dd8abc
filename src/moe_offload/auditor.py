"""Audit: is every tensor where the plan put it?

The silent de-offload class of bugs (a `.contiguous()` on a zero-copy view that makes a
full device copy, a Parameter re-registered without its mark) leaves a model that runs
but holds offloaded weights on the device. The audit looks at where each tensor's bytes
actually are, by address, and reports each mismatch with its bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from .planner import Plan, Tier


@dataclass(frozen=True)
class Mismatch:
    name: str
    planned: str
    actual: str
    bytes: int


def actual_tier(tensor, arena, device) -> str:
    if tensor.device.type == "meta":
        return "missing (meta)"
    if arena is not None and arena.owns(tensor):
        return Tier.HOST.value
    if tensor.device == device:
        return Tier.DEVICE.value
    return f"unplanned copy on {tensor.device}"


def audit(model: nn.Module, plan: Plan) -> list[Mismatch]:
    """Every tensor whose actual tier differs from `plan`; empty when all is in place."""
    runtime = getattr(model, "moe_offload_runtime", None)
    arena = runtime.arena if runtime is not None else None
    device = runtime.device if runtime is not None else next(model.parameters()).device
    tensors = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
    out = []
    for t in plan.tensors:
        live = tensors.get(t.name)
        if live is None:
            out.append(Mismatch(t.name, t.tier, "missing", t.bytes))
            continue
        actual = actual_tier(live, arena, device)
        if actual != t.tier:
            out.append(Mismatch(t.name, t.tier, actual, t.offloaded_bytes or t.bytes))
        if t.host_experts:  # split: the model holds the host part; the first experts must be on the device
            splits = runtime.splits if runtime is not None else {}
            part = splits.get(t.name, (None, 0))[0]
            where = "missing" if part is None else actual_tier(part, arena, device)
            if part is not None and (tuple(part.shape[1:]) != tuple(live.shape[1:]) or part.dtype != live.dtype
                                     or part.shape[0] != t.resident_experts):
                where = f"a part of shape {list(part.shape)}, {part.dtype}"   # no longer one tensor with the host part
            if where != Tier.DEVICE.value or splits[t.name][1] != t.resident_experts:
                out.append(Mismatch(f"{t.name}[:{t.resident_experts}]", Tier.DEVICE.value, where,
                                    t.bytes - t.offloaded_bytes))
    return out
