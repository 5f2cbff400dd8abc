"""Expert-granular placement from routing statistics: the `frequency` policy.

Each expert of each layer (its slices of all the layer's fused expert tensors, which a token
reads together) is one unit of placement, with density = the probability that one decoded
token picks it: its smoothed share of the layer's picks times top_k (`expert_densities`).
Units go to the host lowest density first across the whole model; tensors that are not
fused expert tensors go whole at their usual density (lookup tables, then dense), as
under sparse-first. Pure: the statistics are data passed in (traces.expert_counts).

Three tiers (tiers.py): of the units that left the device, the first in the same order (the least
picked experts) go on to disk until the host tier fits; an expert's slices of its layer's tensors go
together, so every fused tensor of a layer lists the same host_expert_ids and disk_expert_ids.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Mapping, Sequence

from ..errors import SelectorError
from ..model.inventory import Inventory
from .placement import Plan, PlannedTensor, Policy, Tier
from ..model.roles import Role, assign
from .density import is_dense, record_density, record_expert_axis
from .reasons import offload_notes, offload_reason
from .tiers import Unit, cut_to_disk, disk_reason, fill

# Smoothing of routing statistics: every expert counts FREQUENCY_PSEUDOCOUNT picks more than it was seen, so an
# expert no trace saw keeps a small density instead of 0 (and a layer with no statistics is uniform, k/E).
FREQUENCY_PSEUDOCOUNT = 1.0


def routed_layers(inv: Inventory, roles: Sequence[Role] | None = None) -> tuple[int, ...]:
    """The layers holding routed experts, ascending: the `layers` a trace of this model names."""
    roles = assign(inv) if roles is None else roles
    return tuple(sorted({r.layer for r, role in zip(inv.records, roles)
                         if role == Role.ROUTED_EXPERT and r.layer is not None}))


def expert_densities(counts: Sequence[float], top_k: int) -> tuple[float, ...]:
    """Per expert of one layer, the probability that a decoded token picks it, from its pick counts.

    p_e = top_k * (c_e + a) / (sum(c) + a * E), a = FREQUENCY_PSEUDOCOUNT, at most 1: the smoothed share of
    the layer's picks times top_k. It sums to top_k over a layer, as uniform k/E does, so it ranks against
    dense tensors (1) and lookup tables on one scale; an expert never picked gets top_k * a / (sum(c) + a * E),
    small but not 0, and a layer without statistics is uniform.
    """
    a = FREQUENCY_PSEUDOCOUNT
    total = sum(counts) + a * len(counts)
    return tuple(min(1.0, top_k * (c + a) / total) for c in counts)


def _check_stats(stats: Mapping[int, Sequence[float]], inv: Inventory, layers: tuple[int, ...]) -> None:
    fix = "give statistics of this model (`moe-offload profile MODEL --out TRACE`, then --stats TRACE)"
    if not layers:
        raise SelectorError(f"--policy frequency places routed experts, and this {inv.model_type} model has none: "
                            "use sparse-first")
    if set(stats) != set(layers):
        raise SelectorError(f"--stats: the routing statistics cover layers {sorted(stats, key=str)} but this "
                            f"{inv.model_type} model routes layers {list(layers)}; {fix}")
    for layer in layers:
        counts = list(stats[layer])
        if len(counts) != inv.num_experts:
            raise SelectorError(f"--stats: layer {layer} counts {len(counts)} experts but this {inv.model_type} "
                                f"model has {inv.num_experts} per layer; {fix}")
        bad = [c for c in counts if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c)
               or c < 0]
        if bad:
            raise SelectorError(f"--stats: layer {layer} has count {bad[0]!r}; counts are numbers of decode "
                                "tokens, >= 0")


def plan_frequency(inv: Inventory, roles: Sequence[Role], stats: Mapping[int, Sequence[float]], target: int,
                   batch: int, notes: list[str], room: int | None = None,
                   room_label: str = "the host tier") -> Plan:
    """Expert-granular placement: each expert of each layer is a unit, ranked by its pick probability.
    room: the host tier's bytes (None: unbounded); what left the device beyond it goes to disk."""
    records, e, k = inv.records, inv.num_experts, inv.top_k

    def density(i: int) -> float:   # a whole tensor's, as under sparse-first (density.py)
        return record_density(records[i], roles[i], inv, batch)

    layers = routed_layers(inv, roles)
    _check_stats(stats, inv, layers)
    p = {layer: expert_densities(list(stats[layer]), k) for layer in layers}
    fused: dict[int, list[int]] = {}   # layer -> its fused [E, ...] expert tensors: one expert reads all their slices
    for i, (r, role) in enumerate(zip(records, roles)):
        if r.layer is not None and record_expert_axis(r, role, inv):
            fused.setdefault(r.layer, []).append(i)
    in_fused = {i for idx in fused.values() for i in idx}
    # A unit: (density at the batch, dense?, declaration index, expert id or -1, bytes, layer of an expert unit).
    # Ties go to the earlier layer (declaration order), then the lower expert id; dense tensors of equal
    # density after experts, as in sparse-first. Other tensors (not fused) go whole, at their usual density.
    units = [(1.0 - (1.0 - p[layer][x]) ** batch, False, idx[0], x, sum(records[i].bytes // e for i in idx), layer)
             for layer, idx in fused.items() for x in range(e)]
    units += [(density(i), is_dense(roles[i]), i, -1, records[i].bytes, None) for i in range(len(records))
              if i not in in_fused]
    units.sort(key=lambda u: u[:4])
    # The one filling loop (tiers.py), strict order, whole units: off the device, then on to disk.
    order = [Unit(pos, u[4], u[0], u[1]) for pos, u in enumerate(units)]
    off = fill(order, target, slice_=False)
    on_disk = cut_to_disk(order, off, room, room_label=room_label,
                          movable=lambda pos: units[pos][5] is not None or not records[units[pos][2]].is_buffer).taken
    host: dict[int, set[int]] = {layer: set() for layer in fused}   # layer -> experts off the device
    disk: dict[int, set[int]] = {layer: set() for layer in fused}   # layer -> those of them on disk
    whole: set[int] = set()
    whole_disk: set[int] = set()
    for pos in off.taken:
        _, _, i, x, _, layer = units[pos]
        if layer is None:
            whole.add(i)
            if pos in on_disk:
                whole_disk.add(i)
        else:
            host[layer].add(x)
            if pos in on_disk:
                disk[layer].add(x)
    done = off.done
    last = units[off.last] if off.last is not None else None

    tensors, offloaded = [], set()
    for i, (r, role) in enumerate(zip(records, roles)):
        routed = role == Role.ROUTED_EXPERT
        ids = tuple(sorted(host[r.layer])) if i in in_fused else ()
        on = tuple(sorted(disk[r.layer])) if i in in_fused else ()
        off_ = bool(ids) or i in whole
        if off_:
            offloaded.add(i)
        reason = offload_reason(off_, Policy.FREQUENCY, role, density(i), False)
        if ids:
            lo, hi = min(p[r.layer][x] for x in ids), max(p[r.layer][x] for x in ids)
            reason = (f"offloaded by expert: {len(ids)} of {e} experts, picked by {lo:.4g} to {hi:.4g} of decoded "
                      "tokens (routing statistics)")
        tier = Tier.DISK if on or i in whole_disk else Tier.HOST if off_ else Tier.DEVICE
        # disk_expert_ids only when the offloaded experts span host and disk (all on disk: tier "disk" says it)
        t = PlannedTensor(r.name, r.shape, r.dtype, r.bytes, r.layer, r.component, role.value, r.is_buffer,
                          e if routed else None, k if routed else None, tier.value, reason,
                          len(ids), ids, on if len(on) < len(ids) else ())
        if tier is Tier.DISK:
            # A fused tensor's experts are read at their measured densities: the tensor's is their mean.
            at = density(i) if i not in in_fused else sum(1.0 - (1.0 - q) ** batch for q in p[r.layer]) / e
            t = replace(t, reason=disk_reason(t, at, room) + (f"; {reason}" if ids else ""))
        tensors.append(t)

    picks = [sum(stats[layer]) for layer in layers]
    unseen = sum(1 for layer in layers for c in stats[layer] if c == 0)
    floor = min(min(p[layer]) for layer in layers)
    notes.append(f"frequency placement: each expert ranked by the share of decoded tokens that pick it, from "
                 f"{min(picks):g} to {max(picks):g} expert picks per layer, smoothed by {FREQUENCY_PSEUDOCOUNT:g} "
                 f"pick per expert ({unseen} experts never picked rank at {floor:.3g}, not 0)")
    notes += offload_notes(records, roles, offloaded, target, done, None, Policy.FREQUENCY, range(len(records)), {})
    if last is not None and done > target:
        _, _, i, x, nbytes, layer = last
        what = (f"expert {x} of layer {layer}, {nbytes} bytes over its {len(fused[layer])} tensors" if layer is not None
                else f"{records[i].name}, {nbytes} bytes")
        notes.append(f"offloaded {done - target} bytes more than the budget: experts and tensors move whole, and "
                     f"the last one ({what}) crossed the target")
    return Plan(tuple(tensors), inv.model_type, Policy.FREQUENCY.value, target, batch, (), tuple(notes),
                tuple((layer, p[layer]) for layer in layers), room)
