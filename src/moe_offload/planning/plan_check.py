"""A saved plan is input: one check of every field of a plan against the model it is applied to.

Plan.from_json (plan_json.py) checks that a file is a plan at all: every field there, of the right type.
`check_plan` checks that it is a plan of *this* model, from the model's inventory: the model type, the
tensor names both ways, and per tensor its shape, dtype, bytes, layer, component, role, buffer flag, E and
k, its tier, and its expert ids (host_expert_ids / disk_expert_ids within 0..E-1, ascending, distinct,
host_experts their count, disk ids among the host ids, only on a fused routed-expert tensor that is
offloaded); then the plan's own batch, budget, policy and routing statistics. A plan of another model, or
one edited by hand, is then a PlanMismatchError that names the tensor and the field, says what differs
and why it matters, and how to fix it; never a placement silently applied with other figures, nor a
traceback. The loader (moe_offload.load) and the CLI's --plan (cli/options.read_plan_of) call it.
"""

from __future__ import annotations

from ..errors import PlanMismatchError
from ..model.config import DTYPE_NAMES
from ..model.inventory import Inventory, TensorRecord, inventory
from ..model.roles import Role, assign
from .placement import Plan, PlannedTensor, Policy, Tier, expert_tier_problem

_OFFLOADED = (Tier.HOST.value, Tier.DISK.value)
# Why a field that differs from the model matters: the figures or the placement it decides.
_WHY = {
    "bytes": "the plan's byte counts (offloaded, resident, link bytes per token) are sums of it",
    "layer": "it decides which layer's slab holds the tensor and which routed layer an expert is read in",
    "component": "it decides whether a decoded token reads the tensor (towers other than language run at "
                 "prefill only)",
    "role": "the role sets the tensor's access density, and so its place in the order and the link bytes",
    "is_buffer": "a buffer is not a parameter: it counts no parameters and never goes to disk",
    "experts": "E sets a routed tensor's access density and its expert axis",
    "top_k": "k sets a routed tensor's access density, and so the link bytes per token",
}


def plan_dtype(plan: Plan, source) -> tuple[Inventory, str | None]:
    """The model's inventory in the dtype `plan` holds its tensors in, and that dtype's short name (`bf16`), or
    None where the plan keeps the checkpoint's own dtypes. A plan saved with `plan --dtype D` holds its floating
    tensors in D; it is compared with the model counted in D when it differs from that less than from the
    model's own dtypes, so that an edited tensor is named whichever dtype the plan was made in."""
    def differing(inv_: Inventory) -> list[str]:
        records = inv_.by_name()
        return [t.dtype for t in plan.tensors if t.name in records and t.dtype != records[t.name].dtype]

    inv = inventory(source)
    wrong = differing(inv)
    most = max(sorted(set(wrong)), key=wrong.count) if wrong else None
    short = {name: short for short, name in DTYPE_NAMES.items()}.get(most)
    if short is not None:
        held = inventory(source, dtype=short)
        if len(differing(held)) < len(wrong):
            return held, short
    return inv, None


def check_plan(plan: Plan, inv: Inventory, *, source: str = "the plan", model: str = "the model",
               fix: str = "plan this model again") -> None:
    """Raise PlanMismatchError unless every field of `plan` fits the model of `inv`.

    source: what the plan is, for messages (`--plan p.json`); model: the model's path or name; fix: the way
    out, the end of every message."""
    records = inv.by_name()
    planned = {t.name: t for t in plan.tensors}
    stray = sorted(planned.keys() - records.keys())
    missing = sorted(records.keys() - planned.keys())
    if plan.model_type != inv.model_type or stray or missing:
        why = (f"its model_type is {plan.model_type}, and this is a {inv.model_type} model"
               if plan.model_type != inv.model_type else
               f"its tensor {stray[0]} is not in the model" + _more(stray) if stray else
               f"it places no tensor {missing[0]} of the model" + _more(missing))
        raise PlanMismatchError(f"{source} is not a plan of {model}: the plan is for another model ({why}); {fix}")
    roles = dict(zip((r.name for r in inv.records), assign(inv)))
    for t in plan.tensors:
        problem = _tensor_problem(t, records[t.name], roles[t.name], inv, model)
        if problem:
            raise PlanMismatchError(f"{source}: tensor {t.name}, field {problem}; {fix}")
    problem = _plan_problem(plan, inv, roles)
    if problem:
        raise PlanMismatchError(f"{source}: field {problem}; {fix}")


def _more(names: list[str]) -> str:
    return f" (nor {len(names) - 1} more)" if len(names) > 1 else ""


def _tensor_problem(t: PlannedTensor, r: TensorRecord, role: Role, inv: Inventory, model: str) -> str | None:
    """`field: what differs, and why it matters`, or None when the tensor is the model's."""
    if tuple(t.shape) != tuple(r.shape) or t.dtype != r.dtype:
        field = "shape" if tuple(t.shape) != tuple(r.shape) else "dtype"
        return (f"{field}: the plan gives {t.name} shape {list(t.shape)}, {t.dtype}, but {model} loads it as "
                f"{list(r.shape)}, {r.dtype} (plan it with the same dtype)")
    routed = role == Role.ROUTED_EXPERT
    expected = {"bytes": r.bytes, "layer": r.layer, "component": r.component, "role": role.value,
                "is_buffer": r.is_buffer, "experts": inv.num_experts if routed else None,
                "top_k": inv.top_k if routed else None}
    for field, want in expected.items():
        got = getattr(t, field)
        if got != want:
            return f"{field}: the plan says {got!r}, but {model} has {want!r}: {_WHY[field]}"
    if t.tier not in (Tier.DEVICE.value, *_OFFLOADED):
        return f"tier: {t.tier!r} is not a tier: a tensor lies on the device, the host or disk"
    return _ids_problem(t, r)


def _ids_problem(t: PlannedTensor, r: TensorRecord) -> str | None:
    """The expert ids of one tensor: only a fused routed-expert tensor off the device lists them; all of its
    experts is the whole tensor offloaded, any other subset a split."""
    if not (t.host_experts or t.host_expert_ids):
        return _disk_problem(t)
    field = "host_expert_ids" if t.host_expert_ids else "host_experts"
    what = (f"the plan offloads experts {list(t.host_expert_ids)[:8] or t.host_experts} of {t.name} ({t.role}, "
            f"shape {list(t.shape)}, tier {t.tier})")
    experts = t.shape[0] if t.shape else 0
    ids = tuple(t.host_expert_ids)
    whole = ids == tuple(range(experts)) or (not ids and t.host_experts == experts)
    fused = "Experts" in r.module_class or whole   # a whole tensor needs no expert axis to be offloaded
    if not (t.tier in _OFFLOADED and t.role == Role.ROUTED_EXPERT and len(t.shape) >= 2 and fused):
        return (f"{field}: {what}: only a fused routed-expert tensor on the host can go in part (by expert), or "
                "one on the disk tier (its listed experts read from the checkpoint)")
    if not ids:
        if not 0 < t.host_experts <= experts:
            return (f"host_experts: {what}: a fused routed-expert tensor can go in part only with 0 < host_experts "
                    f"<= its {experts} experts")
        return _disk_problem(t)
    bad = [e for e in ids if not (isinstance(e, int) and 0 <= e < experts)]
    if bad:
        return (f"host_expert_ids: {what}: expert id(s) {bad[:5]} are out of range, the tensor has experts "
                f"0..{experts - 1}; the plan is for another model")
    if len(set(ids)) != len(ids):
        dup = sorted({e for e in ids if ids.count(e) > 1})
        return (f"host_expert_ids: {what}: expert id(s) {dup[:5]} are listed more than once; host_expert_ids "
                "must be distinct")
    if list(ids) != sorted(ids):
        return f"host_expert_ids: {what}: host_expert_ids are not sorted; they must be ascending"
    if t.host_experts != len(ids):
        return (f"host_experts: {what}: host_experts says {t.host_experts} experts but host_expert_ids lists "
                f"{len(ids)}; the plan was edited inconsistently")
    return _disk_problem(t)


def _disk_problem(t: PlannedTensor) -> str | None:
    problem = expert_tier_problem(t)
    if problem is None:
        return None
    if not t.offloaded_ids:
        return (f"disk_expert_ids: tensor {t.name} lists disk_expert_ids {list(t.disk_expert_ids)[:8]} but no "
                "experts off the device (host_expert_ids): disk_expert_ids names the part of those on disk")
    return f"disk_expert_ids: {problem.partition(': ')[2]}"


def _plan_problem(plan: Plan, inv: Inventory, roles: dict[str, Role]) -> str | None:
    """The plan's own fields: batch, budget, policy, and the routing statistics of a frequency plan."""
    if plan.batch < 1:
        return f"batch: {plan.batch} sequences decoded together; it is at least 1"
    if plan.budget_bytes < 0 or (plan.host_budget_bytes is not None and plan.host_budget_bytes < 0):
        return "budget_bytes / host_budget_bytes: a budget is a number of bytes >= 0"
    if plan.policy not in {p.value for p in Policy}:
        return (f"policy: {plan.policy!r} is not a policy of moe-offload "
                f"({', '.join(p.value for p in Policy)})")
    frequency = plan.policy == Policy.FREQUENCY.value
    if frequency != bool(plan.expert_densities):
        return ("expert_densities: a frequency plan carries the routing statistics it was made from, and only "
                f"it (this one is {plan.policy} and has {len(plan.expert_densities)} layers of them): its link "
                "bytes per token are weighed by them")
    layers = sorted({r.layer for r in inv.records if roles[r.name] == Role.ROUTED_EXPERT and r.layer is not None})
    given = [layer for layer, _ in plan.expert_densities]
    if frequency and sorted(given) != layers:
        return f"expert_densities: the plan weighs layers {sorted(given)}, but the model routes layers {layers}"
    for layer, p in plan.expert_densities:
        if len(p) != inv.num_experts:
            return (f"expert_densities: layer {layer} lists {len(p)} experts, but the model has {inv.num_experts} "
                    "per layer")
    return None
