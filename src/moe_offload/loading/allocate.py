"""Allocating a plan's tensors before the checkpoint is streamed into them (stream.py).

Device-tier tensors are allocated on the device, host-tier tensors in exact-size host slabs, one per
layer (storage/host.HostArena); a tensor split by expert holds its experts off the device in a slab and
its others in a device tensor (storage/host.ExpertSplit); disk-tier tensors are not allocated (the
runtime reads them from the checkpoint, run/disk_tier.py).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn as nn

from ..planning.placement import Plan, Tier
from ..storage.host import ExpertSplit, HostArena
from ..storage.huge_pages import advise_huge


def allocate(model: nn.Module, plan: Plan, dev: torch.device, arena: HostArena, quant=None):
    """(name -> (host tensor or device tensor, tensor the model holds), split tensors' layouts).

    Host tensors live in per-layer slabs. A routed-expert tensor split between tiers holds its host experts
    as the rows of a slab tensor (the host stack: the tensor the model holds) and its other experts in a
    device tensor (the resident stack): name -> ExpertSplit. A quantized tensor (`quant`: name -> QuantLayout)
    is two tensors as stored, its values and its scales, placed alike: the same tier, slab and split.
    """
    quant = quant or {}
    meta = {**dict(model.named_parameters()), **{n: b for n, b in model.named_buffers()}}
    targets: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    splits: dict[str, ExpertSplit] = {}
    regions: dict[str, list] = defaultdict(list)
    for t in plan.tensors:
        m = meta[t.name]
        q = quant.get(t.name)
        stored = [(t.name, tuple(t.shape), m.dtype)] if q is None else \
            [(t.name, q.data_shape, q.data_dtype), (q.scale_name, q.scale_shape, q.scale_dtype)]
        ids = t.host_ids or None   # a split tensor's experts off the device (plan_check checked them)
        region = f"{t.component}:" + (f"layer {t.layer}" if t.layer is not None else "other")
        for name, shape, tdtype in stored:
            if ids is not None:
                experts = t.shape[0]
                resident = torch.empty((experts - len(ids), *shape[1:]), dtype=tdtype, device=dev)
                advise_huge(resident)   # cpu: 2 MiB pages for what the kernels stream (before the first write)
                splits[name] = ExpertSplit(resident, ids, experts)
                if t.tier == Tier.HOST:   # a disk-tier split: its other experts stay in the checkpoint
                    regions[region].append((name, (len(ids), *shape[1:]), tdtype))
            elif t.tier == Tier.DISK:
                continue
            elif t.tier == Tier.DEVICE:
                x = torch.empty(shape, dtype=tdtype, device=dev)
                advise_huge(x)
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
