"""Why each tensor lies where it does, and what a user must know of a plan: the reason and the notes
that the policies share (planner.py, frequency.py), in the plan's own numbers.
"""

from __future__ import annotations

from typing import Sequence

from ..model.inventory import TensorRecord
from ..model.roles import Role
from .placement import Policy, format_bytes

_gib = format_bytes


def offload_reason(off: bool, policy: Policy, role: Role, density: float, selected: bool) -> str:
    """The reason of one whole tensor: resident or offloaded, and by what rule."""
    if not off:
        return "resident: budget met before this tensor's turn" if selected or policy is not Policy.EXPLICIT \
            else "resident: not selected by --offload-params"
    if policy is Policy.EXPLICIT:
        return "offloaded: selected by --offload-params, declaration order"
    if policy is Policy.DECLARATION:
        return "offloaded: declaration order"
    return f"offloaded: access density {density:.4g} per step"


def offload_notes(records: Sequence[TensorRecord], roles, offloaded: set[int], target: int, done: int, last,
                  policy: Policy, eligible, split: dict[int, int]) -> list[str]:
    """What a user must know of what was offloaded: dense tensors among it, towers left resident, and the
    overshoot past the budget (`split`: index -> experts off the device, for a tensor offloaded in part)."""
    notes = []
    if not offloaded:
        return notes
    routed_total = sum(r.bytes for r, role in zip(records, roles) if role == Role.ROUTED_EXPERT)
    dense_off = [i for i in offloaded if roles[i] not in (Role.ROUTED_EXPERT, Role.EMBEDDING)]
    dense_bytes = sum(records[i].bytes for i in dense_off)
    if dense_off and policy in (Policy.SPARSE_FIRST, Policy.FREQUENCY):
        sparse_off = done - dense_bytes
        notes.append(
            f"dense tensors offloaded: the {_gib(target)} budget exceeds the {_gib(sparse_off)} of routed experts "
            f"and lookup tables ({_gib(routed_total)} routed experts in all), so {len(dense_off)} dense tensors "
            f"({_gib(dense_bytes)}) were offloaded in declaration order; every token reads them in full")
    elif dense_off:
        notes.append(
            f"{len(dense_off)} dense tensors ({_gib(dense_bytes)}) offloaded by {policy.value} order; every decoded "
            "token reads them in full over the link (sparse-first would offload routed experts first)")
    selectable = set(eligible)
    for comp in sorted({r.component for r in records} - {"language"}):
        idx = [i for i, r in enumerate(records) if r.component == comp]
        if not any(i in offloaded for i in idx):
            size = sum(records[i].bytes for i in idx)
            why = ("the budget was met before its turn" if any(i in selectable for i in idx)
                   else "--offload-params selects none of it")
            notes.append(f"the {comp} tower ({_gib(size)}) stays resident: {why}")
    over = done - target
    if over > 0 and last in split:
        r = records[last]
        notes.append(f"offloaded {over} bytes more than the budget: {r.name} went in part (its last {split[last]} "
                     f"of {r.shape[0]} experts, {r.bytes // r.shape[0]} bytes each), and the last expert crossed "
                     "the target")
    elif over > 0 and last is not None:
        notes.append(f"offloaded {over} bytes more than the budget: tensors move whole, and the last one "
                     f"({records[last].name}, {records[last].bytes} bytes) crossed the target")
    return notes
