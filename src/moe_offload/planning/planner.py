"""The planner: records + budget + policy -> Plan. A pure function of its inputs.

Every tensor is ranked by its access density, the expected fraction of its bytes one
decoded step reads (docs/design.md; density.py computes it):

    untied input embedding / lookup table     rows read / rows
    routed expert tensor (E experts, top-k)   1 - (1 - k/E)^b   (b = sequences decoded together)
    everything else                           1

`sparse-first` offloads the lowest densities first, across the whole model; ties go in
declaration order, so dense tensors come last, in declaration order, and only once every
routed expert is offloaded. `declaration` is the legacy order of today's engines.
Explicit selectors make only matching tensors eligible, in declaration order.

`frequency` places expert by expert from routing statistics (decode-token counts per expert
per layer, e.g. traces.expert_counts): one expert of one layer (its slices of all the layer's
fused expert tensors, read together) is one unit, with density = its smoothed share of the
layer's picks times top_k (comparable with dense 1 and uniform k/E; frequency.py).
Units go lowest density first across the model; lookup tables and dense tensors as above.

The expected link traffic per decoded token follows from the same numbers (accounting.py):
    sum over offloaded tensors of bytes * density_b / b

Three tiers (tiers.py): with host_memory_gb (or, on a CPU-only machine, device_memory_gb alone:
cpu_only=True, which the CLI sets from the device it resolves, so that this function stays pure),
the first bytes of the same order that left the device go on to disk until the host tier fits.

Every offloaded tensor with an expert axis lists the experts off the device (host_expert_ids):
its last ones when sparse-first cut it in part, all of them when it went whole.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..errors import BudgetError, SelectorError
from ..model.inventory import Inventory
from .placement import GiB, Plan, PlannedTensor, Policy, Tier, format_bytes
from ..model.roles import Role, assign, family_note
from .density import is_dense, record_density, record_expert_axis
from .frequency import plan_frequency
from .reasons import offload_notes, offload_reason
from .tiers import Unit, cut_to_disk, disk_reason, fill, tier_notes

DEFAULT_RESERVE_GB = 2.0  # activations + KV cache kept free with --device-memory, unless --reserve-gb says otherwise


# ---------------------------------------------------------------------------------------
# Budgets


@dataclass(frozen=True)
class Budget:
    offload_gb: float | None = None
    device_memory_gb: float | None = None
    reserve_gb: float | None = None
    host_memory_gb: float | None = None
    cpu_only: bool = False    # the device is host memory (no accelerator): device_memory_gb alone bounds the RAM

    def validate(self) -> None:
        # Errors name the Python arguments (`offload_gb=5`); the CLI shows its own flags for them (cli._as_flags).
        for label, value in (("offload_gb", self.offload_gb), ("device_memory_gb", self.device_memory_gb),
                             ("reserve_gb", self.reserve_gb), ("host_memory_gb", self.host_memory_gb)):
            if value is not None and (not math.isfinite(value) or value < 0):
                raise BudgetError(f"{label}={value} is not a size: give a non-negative number of GiB")
        if self.offload_gb is not None and self.device_memory_gb is not None:
            raise BudgetError("offload_gb and device_memory_gb both set a budget: give one of them")
        if self.reserve_gb is not None and self.device_memory_gb is None:
            raise BudgetError("reserve_gb only applies with device_memory_gb: add device_memory_gb or drop it")
        if self.host_memory_gb is not None and self.offload_gb is None and self.device_memory_gb is None:
            raise BudgetError(f"host_memory_gb={self.host_memory_gb:g} sizes the host tier for what leaves the "
                              "device, and without offload_gb or device_memory_gb nothing leaves it: add one of "
                              "them, or drop host_memory_gb")

    def host_room(self) -> int | None:
        """Bytes the host tier may hold; what leaves the device beyond them goes to disk. None: unbounded."""
        if self.host_memory_gb is not None:
            return math.floor(self.host_memory_gb * GiB)
        if self.cpu_only and self.device_memory_gb is not None:
            return 0   # the device is host memory: device_memory_gb bounds the RAM, and the rest is on disk
        return None


_gib = format_bytes


def matches_selector(name: str, selector: str) -> bool:
    """vLLM's segment semantics: `experts` matches `...mlp.experts.down_proj`, `expert` does not."""
    segs, want = name.split("."), selector.strip(".").split(".")
    return any(segs[i:i + len(want)] == want for i in range(len(segs) - len(want) + 1))


def _similar(selector: str, names: Sequence[str]) -> list[str]:
    import difflib

    segments = sorted({s for n in names for s in n.split(".") if not s.isdigit()})
    return difflib.get_close_matches(selector.split(".")[-1], segments, n=4, cutoff=0.5)


def plan(inv: Inventory, *, offload_gb: float | None = None, device_memory_gb: float | None = None,
         reserve_gb: float | None = None, policy: str = "sparse-first",
         offload_params: str | Sequence[str] | None = None, batch: int = 1,
         stats: Mapping[int, Sequence[float]] | None = None, host_memory_gb: float | None = None,
         cpu_only: bool = False, runtime_bytes: int = 0) -> Plan:
    """Decide the tier of every tensor. Touches no device, file or global state.

    stats: with policy "frequency", layer -> decode-token picks of each expert (traces.expert_counts).
    host_memory_gb: the host tier's GiB for offloaded weights; what left the device beyond it goes to disk.
    cpu_only: the plan is for a machine without an accelerator, whose device is host memory: there
    device_memory_gb alone bounds the RAM the weights hold and what does not fit goes to disk.
    runtime_bytes: on a CPU-only machine, what the process itself takes beside its weights (measured by the
    caller: storage/process_memory.py); it lives in the reserve, and the plan says how much of the reserve is left.
    """
    budget = Budget(offload_gb, device_memory_gb, reserve_gb, host_memory_gb, bool(cpu_only))
    budget.validate()
    if batch < 1:
        raise BudgetError(f"batch={batch}: the number of sequences decoded together is at least 1")
    if policy == "oracle":
        raise SelectorError("policy 'oracle' is frequency placement with statistics from the very trace it is "
                            "measured on, a floor rather than a placement: only `moe-offload replay` takes it; use "
                            "--policy frequency --stats TRACE")
    try:
        policy_ = Policy(policy)
    except ValueError:
        raise SelectorError(f"unknown policy {policy!r}: use sparse-first, declaration or frequency") from None
    if policy_ is Policy.EXPLICIT:
        raise SelectorError("policy 'explicit' is set by offload_params, not by name")
    if policy_ is Policy.FREQUENCY and stats is None:
        raise SelectorError("--policy frequency needs --stats TRACE: it places experts by how often routers pick "
                            "them; record a trace with `moe-offload profile MODEL --out TRACE`")
    if stats is not None and policy_ is not Policy.FREQUENCY:
        raise SelectorError(f"--stats only applies with --policy frequency (policy {policy_.value} places by "
                            "uniform routing): add --policy frequency or drop --stats")
    if policy_ is Policy.FREQUENCY and offload_params:
        raise SelectorError("--offload-params and --policy frequency both choose what is offloaded: give one "
                            "of them")
    roles = assign(inv)
    records = inv.records
    notes: list[str] = list(inv.notes)
    if (note := family_note(inv)) is not None:
        notes.append(note)

    # Eligibility.
    # One string is one selector (`offload_params="experts"`), not a sequence of one-letter selectors.
    selectors = (offload_params,) if isinstance(offload_params, str) else tuple(offload_params or ())
    if selectors:
        names = [r.name for r in records]
        for sel in selectors:
            if not any(matches_selector(n, sel) for n in names):
                near = _similar(sel, names)
                hint = f"; similar segments: {', '.join(near)}" if near else ""
                raise SelectorError(
                    f"offload_params {sel!r} matches no tensor of this {inv.model_type} model (selectors match "
                    f"whole dot-separated segments){hint}")
        eligible = [i for i, r in enumerate(records) if any(matches_selector(r.name, s) for s in selectors)]
        notes.append(f"--offload-params {' '.join(selectors)}: only the {len(eligible)} selected tensors are "
                     f"eligible, offloaded in declaration order (policy {policy_.value} does not apply)")
        policy_ = Policy.EXPLICIT
    else:
        eligible = list(range(len(records)))
    eligible_bytes = sum(records[i].bytes for i in eligible)
    total = sum(r.bytes for r in records)

    # The offload target.
    if budget.device_memory_gb is not None:
        reserve = budget.reserve_gb if budget.reserve_gb is not None else DEFAULT_RESERVE_GB
        room = math.floor((budget.device_memory_gb - reserve) * GiB)
        if room < 0:
            raise BudgetError(f"device_memory_gb={budget.device_memory_gb} GiB is less than the "
                              f"{reserve} GiB reserve: lower reserve_gb or give the real device memory")
        if budget.cpu_only and runtime_bytes > math.floor(reserve * GiB):
            need = math.ceil(runtime_bytes / GiB * 100) / 100 + 0.25
            raise BudgetError(f"device_memory_gb={budget.device_memory_gb:g} GiB cannot bound this process: on a "
                              f"CPU-only machine it is all the RAM the process may hold, and the process itself "
                              f"takes {_gib(runtime_bytes)} (measured: the interpreter, torch, transformers, the "
                              f"kernels), more than the {reserve:g} GiB reserve that is left for it; give reserve_gb "
                              f"of at least {need:g} (device_memory_gb as much more, "
                              f"{budget.device_memory_gb - reserve + need:g}, to keep the weights' share)")
        target = max(0, total - room)
        if target == 0:
            notes.append(f"the model fits: {_gib(total)} of weights + {reserve:g} GiB reserve <= "
                         f"{budget.device_memory_gb:g} GiB of device memory; nothing offloaded")
        elif target > eligible_bytes:
            raise BudgetError(
                f"the model cannot fit: {_gib(total)} of weights need {_gib(target)} offloaded to leave "
                f"{reserve:g} GiB reserve in {budget.device_memory_gb:g} GiB, but only {_gib(eligible_bytes)} "
                "may be offloaded; widen offload_params, lower reserve_gb or use a larger device")
    elif budget.offload_gb is not None:
        target = math.ceil(budget.offload_gb * GiB)
        if target > eligible_bytes:
            what = "the tensors offload_params selects" if selectors else "the whole model"
            raise BudgetError(f"offload_gb={budget.offload_gb:g} is more than {what} ({_gib(eligible_bytes)}, "
                              f"{eligible_bytes} bytes): give at most {eligible_bytes / GiB:.6g}")
    else:
        target = 0
        notes.append("no budget given (--offload-gb or --device-memory): everything stays on the device")

    # Order of offloading: lowest access density first (density.py), lookup tables and routed experts before
    # dense tensors of equal density.
    def density(i: int) -> float:
        return record_density(records[i], roles[i], inv, batch)

    def dense(i: int) -> bool:
        return is_dense(roles[i])

    room, room_label = budget.host_room(), _room_label(budget)
    if policy_ is Policy.FREQUENCY:
        p = plan_frequency(inv, roles, stats, target, batch, notes, room, room_label)
        return _with_tier_notes(p, budget, runtime_bytes)
    order = sorted(eligible, key=lambda i: (density(i), dense(i), i)) if policy_ is Policy.SPARSE_FIRST else eligible
    # One unit per eligible tensor, in the policy's order; fused expert tensors may go by their last experts.
    axis = [record_expert_axis(r, role, inv) for r, role in zip(records, roles)]
    units = [Unit(i, records[i].bytes, density(i), dense(i), axis[i]) for i in order]
    sparse = policy_ is Policy.SPARSE_FIRST
    off = fill(units, target, slice_=sparse)
    # The disk cut moves whole units (a tensor, or the experts the device cut took of one): the disk tier reads
    # a tensor's experts from disk or from memory, not both (disk_tier.py), so every plan made here loads.
    disk = cut_to_disk(units, off, room, movable=lambda i: not records[i].is_buffer, room_label=room_label).taken
    offloaded = set(off.taken)
    split = {i: n for i, n in off.taken.items() if n}   # index -> experts off the device, for a tensor in part
    done, last = off.done, off.last

    tensors = []
    for i, (r, role) in enumerate(zip(records, roles)):
        routed = role == Role.ROUTED_EXPERT
        tier = (Tier.DISK if i in disk else Tier.HOST) if i in offloaded else Tier.DEVICE
        reason = offload_reason(i in offloaded, policy_, role, density(i), selectors and i in eligible)
        if i in split:
            reason = (f"offloaded in part: its last {split[i]} of {r.shape[0]} experts, the slice that met the "
                      "budget")
        # Every offloaded tensor with an expert axis lists the experts off the device: its last ones when it
        # went in part, all of them when whole (PlannedTensor.host_expert_ids).
        ids = tuple(range(axis[i] - split.get(i, axis[i]), axis[i])) if i in offloaded else ()
        t = PlannedTensor(r.name, r.shape, r.dtype, r.bytes, r.layer, r.component, role.value, r.is_buffer,
                          inv.num_experts if routed else None, inv.top_k if routed else None, tier.value, reason,
                          len(ids), ids)
        tensors.append(dataclasses.replace(t, reason=disk_reason(t, density(i), room)) if i in disk else t)

    notes += offload_notes(records, roles, offloaded, target, done, last, policy_, eligible, split)
    return _with_tier_notes(Plan(tuple(tensors), inv.model_type, policy_.value, target, batch, selectors,
                                 tuple(notes), host_budget_bytes=room), budget, runtime_bytes)


def _room_label(budget: Budget) -> str:
    """The host tier's size as the user set it, for errors."""
    if budget.host_memory_gb is not None:
        return f"the host tier (host_memory_gb={budget.host_memory_gb:g})"
    return ("the host tier of a CPU-only machine with device_memory_gb alone (none: the device is host memory; "
            "host_memory_gb makes one)")


def _with_tier_notes(p: Plan, budget: Budget, runtime_bytes: int = 0) -> Plan:
    extra = tier_notes(p, p.host_budget_bytes, cpu_only=budget.cpu_only,
                       device_bound=budget.device_memory_gb is not None,
                       explicit_room=budget.host_memory_gb is not None)
    if budget.cpu_only and budget.device_memory_gb is not None and runtime_bytes:
        extra.append(_runtime_note(budget, runtime_bytes))
    return dataclasses.replace(p, notes=(*p.notes, *extra)) if extra else p


def _runtime_note(budget: Budget, runtime_bytes: int) -> str:
    """What is left of the reserve once the process itself is in it (CPU-only: the reserve is all the process holds
    beside its weights)."""
    reserve = budget.reserve_gb if budget.reserve_gb is not None else DEFAULT_RESERVE_GB
    left = math.floor(reserve * GiB) - runtime_bytes
    head = (f"CPU-only: the process itself takes {_gib(runtime_bytes)} (measured: the interpreter, torch, "
            f"transformers, the kernels) out of the {reserve:g} GiB reserve")
    return (f"{head}: {_gib(left)} remain for activations, the KV cache and staging (at most 256 MiB of experts "
            "staged per layer step), so the process stays within --device-memory as far as they fit there")
