"""The settings of a bench row, read back from the loaded model, not echoed from the arguments: which tensors'
bytes actually lie in the host arena, by role and by name, how the runtime holds its device-side expert
cache, and how many bytes of weights and staging buffers live on the run device.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from ..run.runtime import runtime_of

SHOWN_NAMES = 32  # offloaded tensor names listed in `settings`; the count is always exact


def applied_settings(model, plan, *, resident: bool = False) -> dict:
    """The plan as it actually lies in memory: what the host arena holds, by role, and by name.

    `resident`: the arm loaded at a zero budget, whose plan carries the default policy's name although no
    policy chose anything; it is reported as policy "resident" once the arena confirms it holds nothing."""
    rt = runtime_of(model)
    role_of = {t.name: t.role for t in plan.tensors}
    # The scales of a quantized tensor (a buffer beside it, quant_weights.py) count with it, under its role.
    owner_of = {q.scale_name: name for name, q in rt.quant.items()}
    by_role: dict[str, int] = defaultdict(int)
    names: list[str] = []
    tensors = [*model.named_parameters(), *model.named_buffers()]
    for name, t in tensors:
        if rt.arena.owns(t):
            by_role[role_of.get(owner_of.get(name, name), "other")] += t.numel() * t.element_size()
            if name not in owner_of:
                names.append(name)
    out = {
        "policy": "resident" if resident and not names else plan.policy,
        "offload_params": list(plan.offload_params),
        "budget_bytes": plan.budget_bytes,
        "backend": rt.backend,
        "device": str(rt.device),
        "host_bytes_by_role": dict(by_role),
        "offloaded_tensor_count": len(names),
        "offloaded_tensors": names[:SHOWN_NAMES],
        # routed-expert tensors split between tiers: name -> experts on the host (read back: the host part)
        "split_tensors": {name: model.get_parameter(name).shape[0] for name in rt.splits if name in role_of},
        # the device-side expert cache as the runtime holds it: None, or its policy, capacity and carved bytes
        "cache": None if rt.cache is None else {"policy": rt.cache.policy_name, "bytes": rt.cache.capacity_bytes,
                                                 "device_bytes": rt.cache.device_bytes,
                                                 "page_bytes": rt.cache.page_bytes},
    }
    if rt.device.type == "cpu":
        out["threads"] = torch.get_num_threads()
    return out


def device_resident_bytes(model) -> int:
    """Bytes of weights and staging buffers that live on the run device (not in the host arena)."""
    rt = runtime_of(model)
    seen: set[int] = set()
    total = 0
    for _, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.device == rt.device and not rt.arena.owns(t) and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    # The device experts of tensors split between tiers, and the prefetch backend's staging buffers
    # (reused device copies of offloaded weights).
    staging = [split.resident for split in rt.splits.values()] + list(getattr(rt, "_staging", {}).values())
    dense = getattr(rt, "_dense", None)
    staging += [b for b in getattr(dense, "ring", []) if b is not None]
    if rt.dequantizer is not None:   # reused buffers quantized weights are dequantized into
        staging += rt.dequantizer.buffers()
    if rt.cache is not None and rt.cache.arena is not None:
        staging.append(rt.cache.arena)
    return total + sum(b.numel() * b.element_size() for b in staging)

