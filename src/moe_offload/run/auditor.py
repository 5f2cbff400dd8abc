"""Audit: is every tensor where the plan put it?

The silent de-offload class of bugs (a `.contiguous()` on a zero-copy view that makes a
full device copy, a Parameter re-registered without its mark) leaves a model that runs
but holds offloaded weights on the device. The audit looks at where each tensor's bytes
actually are, by address, and reports each mismatch with its bytes. A tensor held quantized
is checked with its scales: they lie in its tier (and split alike), its values still stored. A disk-tier
tensor must be one the runtime reads from the checkpoint, held by the model as a meta placeholder.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch.nn as nn

from ..planning.placement import Plan, Tier
from .runtime import runtime_of


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
    runtime = runtime_of(model, required=False)
    arena = runtime.arena if runtime is not None else None
    device = runtime.device if runtime is not None else next(model.parameters()).device
    tensors = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
    out = []
    for t in plan.tensors:
        live = tensors.get(t.name)
        if live is None:
            out.append(Mismatch(t.name, t.tier, "missing", t.bytes))
            continue
        actual = _disk_tier(t.name, live, runtime) or actual_tier(live, arena, device)
        if actual != t.tier:
            out.append(Mismatch(t.name, t.tier, actual, t.offloaded_bytes or t.bytes))
        ids = t.host_ids
        if ids and len(ids) < t.shape[0]:
            out += _audit_split(t, live, runtime, arena, device)
        q = getattr(runtime, "quant", {}).get(t.name)
        if q is not None:
            out += _audit_scales(t, q, live, tensors.get(q.scale_name), runtime, arena, device)
    return out


def _disk_tier(name: str, live, runtime) -> str | None:
    """`disk` for a tensor the runtime reads from the checkpoint and the model holds as a placeholder (meta:
    no memory); None for any other tensor. A disk-tier tensor with real memory behind it is a copy."""
    disk = getattr(runtime, "disk", None)
    if disk is None or name not in disk.tensors:
        return None
    return Tier.DISK.value if live.device.type == "meta" else f"a {live.device} copy of a disk-tier tensor"


def _audit_scales(t, q, values, live, runtime, arena, device) -> list[Mismatch]:
    """A tensor held quantized (quant_weights.py): its scales must lie where its values do, split alike, and
    its values must still be the stored encoding (not a dequantized copy)."""
    scale_bytes = math.prod(q.scale_shape) * q.scale_dtype.itemsize
    if live is None:
        return [Mismatch(q.scale_name, t.tier, "missing", scale_bytes)]
    out = []
    if values.dtype != q.data_dtype:
        out.append(Mismatch(t.name, t.tier, f"{values.dtype} values, not the stored {q.data_dtype}", t.bytes))
    actual = _disk_tier(q.scale_name, live, runtime) or actual_tier(live, arena, device)
    if actual != t.tier:
        out.append(Mismatch(q.scale_name, t.tier, actual, scale_bytes))
    if t.host_ids and len(t.host_ids) < t.shape[0]:
        out += _audit_split(dataclasses.replace(t, name=q.scale_name, bytes=scale_bytes), live, runtime, arena,
                            device)
    return out


def _stack_label(name: str, ids: tuple[int, ...]) -> str:
    """`name[:3]` for experts 0..2, else `name[[0, 3, 5]]`: the experts of one stack, as an index."""
    return f"{name}[:{len(ids)}]" if ids == tuple(range(len(ids))) else f"{name}[{list(ids)}]"


def _audit_split(t, live, runtime, arena, device) -> list[Mismatch]:
    """A tensor split between tiers: the model holds the host stack (checked above by address); the
    resident stack must be one device tensor of the other experts, and the index map the plan's."""
    experts = t.shape[0]
    host_ids = set(t.host_ids)
    resident_ids = tuple(e for e in range(experts) if e not in host_ids)
    label = _stack_label(t.name, resident_ids)
    resident_bytes = t.bytes // experts * len(resident_ids)
    split = (runtime.splits if runtime is not None else {}).get(t.name)
    if split is None:
        return [Mismatch(label, Tier.DEVICE.value, "missing", resident_bytes)]
    part = split.resident
    if tuple(split.host_ids) != tuple(t.host_ids) or split.num_experts != experts:
        return [Mismatch(label, Tier.DEVICE.value, f"an index map with host experts {list(split.host_ids)} of "
                         f"{split.num_experts}", resident_bytes)]
    if (tuple(part.shape[1:]) != tuple(live.shape[1:]) or part.dtype != live.dtype
            or part.shape[0] != len(resident_ids) or live.shape[0] != len(t.host_ids)):
        # no longer two stacks of one tensor's experts
        return [Mismatch(label, Tier.DEVICE.value, f"a part of shape {list(part.shape)}, {part.dtype} beside a "
                         f"host stack of shape {list(live.shape)}", resident_bytes)]
    where = actual_tier(part, arena, device)
    return [] if where == Tier.DEVICE.value else [Mismatch(label, Tier.DEVICE.value, where, resident_bytes)]
