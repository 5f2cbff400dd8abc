"""Placements several runtime tests share, and a recorder of the read plans a generation makes.

Imported explicitly (not a conftest)."""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import pytest

import moe_offload as mo
from moe_offload.planning.placement import Tier
from moe_offload.run import experts as experts_module


def three_tier_plan(folder, split: dict, layout: str = "split"):
    """A three-layer model's plan: layer 0's routed tensors split device / host (`split`: local name -> the expert
    ids off the device), layer 1's on the host, layer 2's split device / disk; `layout="whole"`: every routed
    tensor whole on the host."""
    def place(t):
        if t.role != "routed_expert":
            return t
        if layout == "whole" or t.layer == 1:
            return dataclasses.replace(t, tier=Tier.HOST.value)
        ids = split[t.name.rpartition(".")[2]]
        tier = Tier.HOST if t.layer == 0 else Tier.DISK
        return dataclasses.replace(t, tier=tier.value, host_experts=len(ids), host_expert_ids=ids)

    p0 = mo.plan(folder, offload_gb=0)
    return dataclasses.replace(p0, tensors=tuple(place(t) for t in p0.tensors))


@contextmanager
def recorded_plans():
    """The read plan (run/read_plan.StepPlan) of every layer step the experts function plans inside the block."""
    plans = []
    real = experts_module.plan_step

    def keep(*args, **kw):
        plans.append(real(*args, **kw))
        return plans[-1]

    mp = pytest.MonkeyPatch()
    mp.setattr(experts_module, "plan_step", keep)
    try:
        yield plans
    finally:
        mp.undo()
