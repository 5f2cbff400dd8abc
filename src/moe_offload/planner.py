"""The planner: records + budget + policy -> Plan. A pure function of its inputs.

Every tensor is ranked by its access density, the expected fraction of its bytes one
decoded step reads (DESIGN.md):

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
layer's picks times top_k (comparable with dense 1 and uniform k/E; see expert_densities).
Units go lowest density first across the model; lookup tables and dense tensors as above.

The expected link traffic per decoded token follows from the same numbers (accounting.py):
    sum over offloaded tensors of bytes * density_b / b
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Mapping, Sequence

from .accounting import TokenBytes
from .errors import BudgetError, SelectorError
from .inventory import Inventory, TensorRecord
from .roles import Role, assign, family_note

GiB = 1 << 30
DEFAULT_RESERVE_GB = 2.0  # activations + KV cache kept free with --device-memory, unless --reserve-gb says otherwise
PLAN_FORMAT = 1
# Smoothing of routing statistics: every expert counts FREQUENCY_PSEUDOCOUNT picks more than it was seen, so an
# expert no trace saw keeps a small density instead of 0 (and a layer with no statistics is uniform, k/E).
FREQUENCY_PSEUDOCOUNT = 1.0


class Tier(str, Enum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


class Policy(str, Enum):
    SPARSE_FIRST = "sparse-first"
    DECLARATION = "declaration"
    FREQUENCY = "frequency"  # expert by expert, from routing statistics (`stats`)
    EXPLICIT = "explicit"  # set by `offload_params`, not chosen by name


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    layer: int | None
    component: str
    role: str
    is_buffer: bool
    experts: int | None     # E, for routed experts
    top_k: int | None       # k, for routed experts
    tier: str
    reason: str
    # A routed-expert tensor [E, ...] split between tiers: its last `host_experts` experts are on the host,
    # the others on the device (tier "host"). 0: the tensor lies whole in its tier.
    host_experts: int = 0
    # The sorted ids of the experts on the host when the tensor is offloaded in part or whole by expert
    # (frequency placement: any subset, not only the last n). Empty: the last `host_experts` experts, if any.
    host_expert_ids: tuple[int, ...] = ()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def host_ids(self) -> tuple[int, ...]:
        """Ids of the experts of a split tensor that lie on the host (ascending); () for a whole tensor."""
        if self.host_expert_ids:
            return self.host_expert_ids
        if self.host_experts:
            return tuple(range(self.shape[0] - self.host_experts, self.shape[0]))
        return ()

    @property
    def resident_experts(self) -> int:
        """Experts [0, resident_experts) of a split tensor stay on the device."""
        return self.shape[0] - self.host_experts if self.host_experts else 0

    @property
    def offloaded_bytes(self) -> int:
        if self.tier == Tier.DEVICE:
            return 0
        if self.host_experts:
            return self.bytes // self.shape[0] * self.host_experts
        return self.bytes

    def density(self, batch: int = 1) -> float:
        """Expected fraction of this tensor's bytes read by one decode step of `batch` sequences."""
        if self.role == Role.ROUTED_EXPERT and self.experts and self.top_k:
            return 1.0 - (1.0 - self.top_k / self.experts) ** batch
        if self.role == Role.EMBEDDING and self.shape:
            return min(batch, self.shape[0]) / self.shape[0]
        return 1.0


@dataclass(frozen=True)
class Plan:
    tensors: tuple[PlannedTensor, ...]
    model_type: str
    policy: str
    budget_bytes: int
    batch: int = 1
    offload_params: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())
    # frequency plans: (layer, per expert the probability that one decoded token picks it), from the statistics
    expert_densities: tuple[tuple[int, tuple[float, ...]], ...] = ()

    # --- views -------------------------------------------------------------------------
    @property
    def tiers(self) -> dict[str, str]:
        return {t.name: t.tier for t in self.tensors}

    @property
    def total_bytes(self) -> int:
        return sum(t.bytes for t in self.tensors)

    @property
    def offloaded_bytes(self) -> int:
        return sum(t.offloaded_bytes for t in self.tensors)

    @property
    def resident_bytes(self) -> int:
        return self.total_bytes - self.offloaded_bytes

    @property
    def total_params(self) -> int:
        return sum(t.numel for t in self.tensors if not t.is_buffer)

    @property
    def active_params(self) -> int:
        """Parameters read per decoded token: all but the input embedding, routed experts at k/E."""
        total = 0.0
        for t in self.tensors:
            if t.is_buffer or t.role == Role.EMBEDDING:
                continue
            total += t.numel * (t.top_k / t.experts if t.role == Role.ROUTED_EXPERT and t.experts else 1.0)
        return round(total)

    @property
    def frequencies(self) -> dict[int, tuple[float, ...]] | None:
        """layer -> per-expert pick probability of a frequency plan; None: uniform routing is assumed."""
        return dict(self.expert_densities) if self.expert_densities else None

    def token_bytes(self) -> TokenBytes:
        """What a decoded token of this plan reads from each tier (accounting.py)."""
        return TokenBytes.of(self.tensors)

    def link_bytes_per_token(self, batch: int | None = None) -> float:
        """Expected bytes of offloaded weights read per decoded token (accounting.TokenBytes.expected).

        Towers other than the language model (vision, audio) run at prefill only: a decoded
        token reads none of their bytes. (They still rank as dense tensors, after the experts.)
        Frequency plans weigh each expert by its measured pick probability, others by k/E.
        """
        return self.token_bytes().expected_total(batch or self.batch, self.frequencies)

    def roles(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {r.value: {"params": 0, "bytes": 0, "offloaded_bytes": 0} for r in Role}
        for t in self.tensors:
            row = out[t.role]
            row["params"] += 0 if t.is_buffer else t.numel
            row["bytes"] += t.bytes
            row["offloaded_bytes"] += t.offloaded_bytes
        return out

    # --- serialisation -----------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format": PLAN_FORMAT,
            "model_type": self.model_type,
            "policy": self.policy,
            "batch": self.batch,
            "offload_params": list(self.offload_params),
            "total_params": self.total_params,
            "active_params": self.active_params,
            "total_bytes": self.total_bytes,
            "offloaded_bytes": self.offloaded_bytes,
            "resident_bytes": self.resident_bytes,
            "budget_bytes": self.budget_bytes,
            "link_bytes_per_token": self.link_bytes_per_token(),
            "roles": self.roles(),
            "tensors": [dict(asdict(t), shape=list(t.shape)) for t in self.tensors],
            "notes": list(self.notes),
            "expert_densities": {str(layer): list(p) for layer, p in self.expert_densities},
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        from .errors import MoeOffloadError

        try:
            data = json.loads(text)
            if data.get("format") != PLAN_FORMAT:
                raise ValueError(f"plan format {data.get('format')!r}, this moe-offload reads format {PLAN_FORMAT}")
            tensors = tuple(PlannedTensor(**{**t, "shape": tuple(t["shape"]), "tier": Tier(t["tier"]).value,
                                             "host_expert_ids": tuple(t.get("host_expert_ids", ()))})
                            for t in data["tensors"])
            densities = tuple((int(layer), tuple(float(x) for x in p))
                              for layer, p in data.get("expert_densities", {}).items())
            return cls(tensors, data["model_type"], data["policy"], int(data["budget_bytes"]), int(data["batch"]),
                       tuple(data.get("offload_params", ())), tuple(data.get("notes", ())), densities)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise MoeOffloadError(f"not a moe-offload plan ({type(exc).__name__}: {exc}); save one with "
                                  "`moe-offload plan --save PLAN.json`") from exc


# ---------------------------------------------------------------------------------------
# Budgets


@dataclass(frozen=True)
class Budget:
    offload_gb: float | None = None
    device_memory_gb: float | None = None
    reserve_gb: float | None = None

    def validate(self) -> None:
        # Errors name the Python arguments (`offload_gb=5`); the CLI shows its own flags for them (cli._as_flags).
        for label, value in (("offload_gb", self.offload_gb), ("device_memory_gb", self.device_memory_gb),
                             ("reserve_gb", self.reserve_gb)):
            if value is not None and (not math.isfinite(value) or value < 0):
                raise BudgetError(f"{label}={value} is not a size: give a non-negative number of GiB")
        if self.offload_gb is not None and self.device_memory_gb is not None:
            raise BudgetError("offload_gb and device_memory_gb both set a budget: give one of them")
        if self.reserve_gb is not None and self.device_memory_gb is None:
            raise BudgetError("reserve_gb only applies with device_memory_gb: add device_memory_gb or drop it")


def format_bytes(n: float) -> str:
    """Bytes for people: GiB, MiB or KiB with 2 decimals (powers of 2), or plain bytes."""
    for unit, size in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


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
         stats: Mapping[int, Sequence[float]] | None = None) -> Plan:
    """Decide the tier of every tensor. Touches no device, file or global state.

    stats: with policy "frequency", layer -> decode-token picks of each expert (traces.expert_counts).
    """
    budget = Budget(offload_gb, device_memory_gb, reserve_gb)
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

    # Order of offloading.
    def density(i: int) -> float:
        r, role = records[i], roles[i]
        if role == Role.ROUTED_EXPERT and inv.num_experts and inv.top_k:
            return 1.0 - (1.0 - inv.top_k / inv.num_experts) ** batch
        if role == Role.EMBEDDING:
            return min(batch, r.shape[0]) / r.shape[0]
        return 1.0

    # Lookup tables and routed experts go before dense tensors of equal density: at a large batch an expert's
    # density rounds to 1.0 in floating point, and dense tensors declared first must still not overtake it.
    def dense(i: int) -> bool:
        return roles[i] not in (Role.ROUTED_EXPERT, Role.EMBEDDING)

    if policy_ is Policy.FREQUENCY:
        return _plan_frequency(inv, roles, stats, target, batch, notes, density, dense)
    order = sorted(eligible, key=lambda i: (density(i), dense(i), i)) if policy_ is Policy.SPARSE_FIRST else eligible
    offloaded: set[int] = set()
    split: dict[int, int] = {}   # index -> experts on the host, for a routed-expert tensor offloaded in part
    done = 0
    last = None
    for pos, i in enumerate(order):
        if done >= target:
            break
        need = target - done
        if policy_ is Policy.SPARSE_FIRST and not dense(i) and records[i].bytes >= need:
            # This routed-expert (or lookup) tensor would finish the budget. Every remaining tensor of its
            # kind (same density) costs its bytes x that density per step, so the smallest one that alone
            # covers what is left keeps the overshoot, and what it costs, down: Mixtral's down_proj rather
            # than its twice-as-large gate_up_proj. Dense tensors keep strict declaration order.
            kind = (density(i), dense(i))
            covering = [j for j in order[pos:] if (density(j), dense(j)) == kind and records[j].bytes >= need]
            sliceable = [j for j in covering if _experts_of(records[j], roles[j], inv)]
            if sliceable:
                # Fused expert tensors can go in part: the last n of their E experts. The smallest expert
                # slice overshoots least; the overshoot is then below one expert slice.
                i = min(sliceable, key=lambda j: records[j].bytes // _experts_of(records[j], roles[j], inv))
                experts = _experts_of(records[i], roles[i], inv)
                per_expert = records[i].bytes // experts
                n = -(-need // per_expert)
                if n < experts:
                    split[i] = n
                    offloaded.add(i)
                    done += per_expert * n
                    last = i
                    break
            else:
                i = min(covering, key=lambda j: records[j].bytes)
        offloaded.add(i)
        done += records[i].bytes
        last = i

    tensors = []
    for i, (r, role) in enumerate(zip(records, roles)):
        routed = role == Role.ROUTED_EXPERT
        tier = Tier.HOST if i in offloaded else Tier.DEVICE
        reason = _reason(i in offloaded, policy_, role, density(i), selectors and i in eligible)
        if i in split:
            reason = (f"offloaded in part: its last {split[i]} of {r.shape[0]} experts, the slice that met the "
                      "budget")
        tensors.append(PlannedTensor(
            r.name, r.shape, r.dtype, r.bytes, r.layer, r.component, role.value, r.is_buffer,
            inv.num_experts if routed else None, inv.top_k if routed else None, tier.value, reason,
            split.get(i, 0)))

    notes += _notes(records, roles, offloaded, target, done, last, policy_, eligible, split)
    return Plan(tuple(tensors), inv.model_type, policy_.value, target, batch, selectors, tuple(notes))


def _experts_of(record: TensorRecord, role: Role, inv: Inventory) -> int:
    """E for a fused routed-expert tensor [E, ...] that can be offloaded expert by expert, else 0."""
    e = inv.num_experts
    if role != Role.ROUTED_EXPERT or not e or len(record.shape) < 2 or record.shape[0] != e or e < 2 \
            or "Experts" not in record.module_class:   # only a fused experts module's tensors have an expert axis
        return 0
    return e if record.bytes % e == 0 else 0


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


def _plan_frequency(inv: Inventory, roles: Sequence[Role], stats: Mapping[int, Sequence[float]], target: int,
                    batch: int, notes: list[str], density, dense) -> Plan:
    """Expert-granular placement: each expert of each layer is a unit, ranked by its pick probability."""
    records, e, k = inv.records, inv.num_experts, inv.top_k
    layers = routed_layers(inv, roles)
    _check_stats(stats, inv, layers)
    p = {layer: expert_densities(list(stats[layer]), k) for layer in layers}
    fused: dict[int, list[int]] = {}   # layer -> its fused [E, ...] expert tensors: one expert reads all their slices
    for i, (r, role) in enumerate(zip(records, roles)):
        if r.layer is not None and _experts_of(r, role, inv):
            fused.setdefault(r.layer, []).append(i)
    in_fused = {i for idx in fused.values() for i in idx}
    # A unit: (density at the batch, dense?, declaration index, expert id or -1, bytes, layer of an expert unit).
    # Ties go to the earlier layer (declaration order), then the lower expert id; dense tensors of equal
    # density after experts, as in sparse-first. Other tensors (not fused) go whole, at their usual density.
    units = [(1.0 - (1.0 - p[layer][x]) ** batch, False, idx[0], x, sum(records[i].bytes // e for i in idx), layer)
             for layer, idx in fused.items() for x in range(e)]
    units += [(density(i), dense(i), i, -1, records[i].bytes, None) for i in range(len(records)) if i not in in_fused]
    units.sort(key=lambda u: u[:4])
    host: dict[int, set[int]] = {layer: set() for layer in fused}
    whole: set[int] = set()
    done, last = 0, None
    for unit in units:
        if done >= target:
            break
        _, _, i, x, nbytes, layer = unit
        if layer is None:
            whole.add(i)
        else:
            host[layer].add(x)
        done += nbytes
        last = unit

    tensors, offloaded = [], set()
    for i, (r, role) in enumerate(zip(records, roles)):
        routed = role == Role.ROUTED_EXPERT
        ids = tuple(sorted(host[r.layer])) if i in in_fused else ()
        off = bool(ids) or i in whole
        if off:
            offloaded.add(i)
        reason = _reason(off, Policy.FREQUENCY, role, density(i), False)
        if ids:
            lo, hi = min(p[r.layer][x] for x in ids), max(p[r.layer][x] for x in ids)
            reason = (f"offloaded by expert: {len(ids)} of {e} experts, picked by {lo:.4g} to {hi:.4g} of decoded "
                      "tokens (routing statistics)")
        tensors.append(PlannedTensor(
            r.name, r.shape, r.dtype, r.bytes, r.layer, r.component, role.value, r.is_buffer,
            e if routed else None, k if routed else None, (Tier.HOST if off else Tier.DEVICE).value, reason,
            len(ids), ids))

    picks = [sum(stats[layer]) for layer in layers]
    unseen = sum(1 for layer in layers for c in stats[layer] if c == 0)
    floor = min(min(p[layer]) for layer in layers)
    notes.append(f"frequency placement: each expert ranked by the share of decoded tokens that pick it, from "
                 f"{min(picks):g} to {max(picks):g} expert picks per layer, smoothed by {FREQUENCY_PSEUDOCOUNT:g} "
                 f"pick per expert ({unseen} experts never picked rank at {floor:.3g}, not 0)")
    notes += _notes(records, roles, offloaded, target, done, None, Policy.FREQUENCY, range(len(records)), {})
    if last is not None and done > target:
        _, _, i, x, nbytes, layer = last
        what = (f"expert {x} of layer {layer}, {nbytes} bytes over its {len(fused[layer])} tensors" if layer is not None
                else f"{records[i].name}, {nbytes} bytes")
        notes.append(f"offloaded {done - target} bytes more than the budget: experts and tensors move whole, and "
                     f"the last one ({what}) crossed the target")
    return Plan(tuple(tensors), inv.model_type, Policy.FREQUENCY.value, target, batch, (), tuple(notes),
                tuple((layer, p[layer]) for layer in layers))


def _reason(off: bool, policy: Policy, role: Role, density: float, selected: bool) -> str:
    if not off:
        return "resident: budget met before this tensor's turn" if selected or policy is not Policy.EXPLICIT \
            else "resident: not selected by --offload-params"
    if policy is Policy.EXPLICIT:
        return "offloaded: selected by --offload-params, declaration order"
    if policy is Policy.DECLARATION:
        return "offloaded: declaration order"
    return f"offloaded: access density {density:.4g} per step"


def _notes(records: Sequence[TensorRecord], roles, offloaded: set[int], target: int, done: int, last,
           policy: Policy, eligible, split: dict[int, int]) -> list[str]:
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
