"""Three tiers: what leaves the device, and of that, what goes on to disk. Pure, like the planner.

The policies (planner.py, frequency.py) put their units in an order, lowest access density first
(or declaration order). One loop, `fill`, takes units off a tier in that order until a target is
met; it runs twice:

    device -> offloaded   target: the offload budget (offload_gb, or what device_memory_gb leaves over)
    offloaded -> disk     target: what left the device beyond the host tier's room

so the first bytes of the order go furthest: the device keeps the highest densities, the host the
next (at most `room` bytes), the disk the lowest, read from the checkpoint's own safetensors files at
run time. The room is host_memory_gb; on a CPU-only machine the device *is* host memory, so there
device_memory_gb alone bounds the RAM the weights hold and the room is 0: everything that does not
fit goes to disk (`Budget.host_room`). Without either the host tier is unbounded (two tiers).

Sparse-first may end the device cut inside one fused expert tensor, by its last experts; the disk cut
moves whole units (a tensor, or the experts the device cut took of one), since the disk tier reads a
tensor's experts from disk or from memory, not both. (PlannedTensor's data model, host_expert_ids = the
experts off the device and disk_expert_ids = the part of them on disk, also holds a tensor in all three
tiers, as a saved plan may.) The declaration order and explicit selectors move whole tensors; frequency units are whole
experts, so a frequency plan may put some experts of one layer in host memory and others on disk.
Buffers never go to disk (a checkpoint need not store them): they stay in host memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ..errors import BudgetError
from .placement import GiB, Plan, PlannedTensor, Tier, format_bytes


@dataclass(frozen=True)
class Unit:
    """One thing a policy may move off a tier, at its place in the policy's order."""

    key: int              # what the caller places: a tensor index, or a frequency unit's position
    nbytes: int           # bytes it moves
    density: float        # access density per step at the plan's batch
    dense: bool           # a dense tensor (not a routed expert or lookup table): never sliced or swapped ahead
    experts: int = 0      # > 0: a fused expert tensor's experts, movable in part by its last ones (nbytes // experts)


@dataclass(frozen=True)
class Fill:
    taken: dict[int, int]   # key -> experts moved (the unit's last ones); 0: the whole unit
    done: int               # bytes moved
    last: int | None        # the key of the unit that crossed the target


def fill(units: Sequence[Unit], target: int, *, slice_: bool) -> Fill:
    """Take units in order until `target` bytes are taken; `slice_` (sparse-first) lets the last one be the
    best of its kind and go in part. The overshoot is then below one expert slice, else below one unit."""
    taken: dict[int, int] = {}
    done, last = 0, None
    for pos, u in enumerate(units):
        if done >= target:
            break
        need = target - done
        if slice_ and not u.dense and u.nbytes >= need:
            # This routed-expert (or lookup) unit would finish the target. Every remaining unit of its kind
            # (same density) costs its bytes x that density per step, so the smallest one that alone covers
            # what is left keeps the overshoot, and what it costs, down: Mixtral's down_proj rather than its
            # twice-as-large gate_up_proj. Dense tensors keep strict order.
            covering = [v for v in units[pos:] if (v.density, v.dense) == (u.density, u.dense) and v.nbytes >= need]
            sliceable = [v for v in covering if v.experts]
            if sliceable:
                # Fused expert tensors can go in part: their last n experts. The smallest expert slice
                # overshoots least; the overshoot is then below one expert slice.
                u = min(sliceable, key=lambda v: v.nbytes // v.experts)
                per_expert = u.nbytes // u.experts
                n = -(-need // per_expert)
                if n < u.experts:
                    taken[u.key] = n
                    return Fill(taken, done + per_expert * n, u.key)
            else:
                u = min(covering, key=lambda v: v.nbytes)
        taken[u.key] = 0
        done += u.nbytes
        last = u.key
    return Fill(taken, done, last)


def cut_to_disk(units: Sequence[Unit], off: Fill, room: int | None, *, movable: Callable[[int], bool],
                room_label: str) -> Fill:
    """Of what `off` took off the device, the first units in the order of `units` go to disk, whole, until the
    host holds at most `room` bytes (the overshoot is below one unit). Keys absent from the result stay on the
    host. `movable(key)`: may go to disk."""
    need = off.done - room if room is not None else 0
    if need <= 0:
        return Fill({}, 0, None)
    left = []
    for u in units:
        if u.key not in off.taken or not movable(u.key):
            continue
        n = off.taken[u.key]
        # What went in part offers its n experts off the device (the last n), together.
        left.append(Unit(u.key, u.nbytes // u.experts * n, u.density, u.dense) if n else u)
    movable_bytes = sum(u.nbytes for u in left)
    if need > movable_bytes:
        stay = off.done - movable_bytes
        raise BudgetError(
            f"host memory too small: {format_bytes(off.done)} ({off.done} bytes) leave the device and {room_label} "
            f"holds {room} bytes, so {need} bytes must go to disk, but only {movable_bytes} bytes of it may "
            f"(buffers are not read from the checkpoint: {stay} bytes must stay in host memory); give "
            f"host_memory_gb={stay / GiB:.6g} or more, or a larger device budget")
    return fill(left, need, slice_=False)


def disk_reason(t: PlannedTensor, density: float, room: int) -> str:
    """The reason of a PlannedTensor `t` with bytes on disk: whole (all its experts, if it lists them), or by
    expert."""
    if not t.host_ids and not t.memory_ids:
        return (f"on disk: access density {density:.4g} per step, among the lowest of what left the device "
                f"(the host tier holds {format_bytes(room)})")
    where = [f"expert{'s' if len(t.disk_ids) > 1 else ''} {_ids(t.disk_ids)} of {t.shape[0]} on disk"]
    if t.memory_ids:
        where.append(f"{_ids(t.memory_ids)} in host memory")
    if len(t.host_ids) < t.shape[0]:
        where.append("the others on the device")
    return f"split by expert: {', '.join(where)} (the host tier holds {format_bytes(room)})"


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def _ids(ids: Sequence[int]) -> str:
    ids = list(ids)
    if len(ids) > 2 and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}"
    return ",".join(map(str, ids[:8])) + ("..." if len(ids) > 8 else "")


def tier_notes(plan: Plan, room: int | None, *, cpu_only: bool, device_bound: bool, explicit_room: bool
               ) -> list[str]:
    """What a user must know of a three-tier plan, with the numbers: how much went where, and what a decoded
    token reads from each tier (the finished plan's own accounting)."""
    if room is None:
        return []
    notes = []
    if cpu_only and device_bound and not explicit_room:
        notes.append(f"CPU-only: the device is this machine's memory, so --device-memory bounds the RAM the "
                     f"weights hold ({format_bytes(plan.resident_bytes)} resident) and what does not fit is read "
                     "from the checkpoint on disk (no host tier; --host-memory X keeps X GiB of it in RAM)")
    if not plan.offloaded_bytes:
        return notes
    host_link, disk_read = plan.link_bytes_by_tier()
    if not plan.disk_bytes:
        notes.append(f"the host tier ({format_bytes(room)}) holds all {format_bytes(plan.offloaded_bytes)} offloaded: "
                     "nothing on disk")
        return notes
    on_disk = [t for t in plan.tensors if t.tier == Tier.DISK]
    part = sum(1 for t in on_disk if t.disk_bytes < t.bytes)   # by expert: the rest on the device or the host
    fit = ("have no host tier to go to" if not room else
           f"do not fit the {format_bytes(room)} host tier ({format_bytes(plan.host_bytes)} there)")
    notes.append(
        f"disk tier: {format_bytes(plan.disk_bytes)} ({plan.disk_bytes} bytes) of the "
        f"{format_bytes(plan.offloaded_bytes)} offloaded {fit}: {_count(len(on_disk) - part, 'tensor')} whole and "
        f"{part} in part (by expert), the lowest access densities, are read from the checkpoint's safetensors files "
        "at run time; a "
        f"decoded token reads {format_bytes(disk_read)} from disk and {format_bytes(host_link)} from host memory "
        f"(expected, batch {plan.batch})")
    return notes
