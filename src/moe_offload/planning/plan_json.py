"""Reading a saved plan: the JSON that Plan.to_dict writes, back into the plain values a Plan is built from.

Every field's type is checked as it is read, and a wrong one is a ValueError that names the tensor and
the field (Plan.from_json, placement.py, makes it a user error). Fields that are views of the others
(`total_bytes`, `link_bytes_per_token`, `roles`, ...) are not read: the Plan computes them again.

Plans saved before every offloaded expert tensor listed its experts are read in today's form: a count
`host_experts` with no ids meant the last experts, and an offloaded tensor with an expert axis and
neither meant all of them; both become the ids (`normalised`). Whether the plan fits the model it is
applied to is plan_check.py's job, with the model's inventory.
"""

from __future__ import annotations

import math

from .density import expert_axis

TIERS = ("device", "host", "disk")

# Tensor fields: name -> (type check, what it must be, required). A PlannedTensor is built from exactly these.
_INT = (lambda v: isinstance(v, int) and not isinstance(v, bool))
_COUNT = (lambda v: _INT(v) and v >= 0)
_IDS = (lambda v: isinstance(v, list) and all(_INT(x) for x in v))
TENSOR_FIELDS = {
    "name": (lambda v: isinstance(v, str) and v != "", "a tensor name", True),
    "shape": (lambda v: isinstance(v, list) and all(_COUNT(x) for x in v), "a list of non-negative ints", True),
    "dtype": (lambda v: isinstance(v, str), "a dtype name such as bfloat16", True),
    "bytes": (_COUNT, "a number of bytes, an int >= 0", True),
    "layer": (lambda v: v is None or _COUNT(v), "a layer number or null", True),
    "component": (lambda v: isinstance(v, str), "a component name such as language", True),
    "role": (lambda v: isinstance(v, str), "a role name such as routed_expert", True),
    "is_buffer": (lambda v: isinstance(v, bool), "true or false", True),
    "experts": (lambda v: v is None or _COUNT(v), "the number of experts, or null", True),
    "top_k": (lambda v: v is None or _COUNT(v), "the experts a token picks, or null", True),
    "tier": (lambda v: v in TIERS, f"one of {', '.join(TIERS)}", True),
    "reason": (lambda v: isinstance(v, str), "a string", True),
    "host_experts": (_INT, "the number of experts off the device, an int", False),
    "host_expert_ids": (_IDS, "a list of expert ids (ints)", False),
    "disk_expert_ids": (_IDS, "a list of expert ids (ints)", False),
}
_DEFAULTS = {"host_experts": 0, "host_expert_ids": [], "disk_expert_ids": []}


def _field_error(where: str, field: str, value, want: str) -> ValueError:
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    return ValueError(f"{where}: field {field!r} is {shown}; it must be {want}")


def read_tensor(t, index: int) -> dict:
    """One tensor object of a saved plan, type-checked and normalised: the keyword arguments of PlannedTensor."""
    if not isinstance(t, dict):
        raise ValueError(f"tensors[{index}] is {type(t).__name__}, not an object with the fields of one tensor")
    where = f"tensor {t['name']}" if isinstance(t.get("name"), str) and t["name"] else f"tensors[{index}]"
    unknown = sorted(set(t) - set(TENSOR_FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r}; a tensor has the fields {', '.join(TENSOR_FIELDS)}")
    for field, (ok, want, required) in TENSOR_FIELDS.items():
        if field not in t:
            if required:
                raise ValueError(f"{where}: field {field!r} is missing; it must be {want}")
            continue
        if not ok(t[field]):
            raise _field_error(where, field, t[field], want)
    t = {**_DEFAULTS, **t}
    t = normalised(t)
    return {**t, "shape": tuple(t["shape"]), "host_expert_ids": tuple(t["host_expert_ids"]),
            "disk_expert_ids": tuple(t["disk_expert_ids"])}


def normalised(t: dict) -> dict:
    """A saved tensor in today's form: every offloaded tensor with an expert axis lists its experts off the
    device in host_expert_ids, and host_experts is their count. Older plans gave a count alone (its last
    experts, sparse-first) or, for a tensor offloaded whole, neither (all of them)."""
    if t["host_expert_ids"] or t["tier"] == "device":
        return t
    n, rows = t["host_experts"], t["shape"][0] if t["shape"] else 0
    if 0 < n <= rows:
        return {**t, "host_expert_ids": list(range(rows - n, rows))}
    if n == 0 and expert_axis(t["role"], t["shape"], t["bytes"], t["experts"]):
        return {**t, "host_experts": rows, "host_expert_ids": list(range(rows))}
    return t   # a count out of range: plan_check names it


def read_plan(data, plan_format: int) -> tuple[dict, list[dict]]:
    """(the Plan's own fields, its tensors' PlannedTensor fields) of a saved plan's parsed JSON."""
    if not isinstance(data, dict):
        raise ValueError(f"the file holds a JSON {type(data).__name__}, not a plan object")
    if data.get("format") != plan_format:
        raise ValueError(f"plan format {data.get('format')!r}, this moe-offload reads format {plan_format}")
    for field, ok, want in (("model_type", lambda v: isinstance(v, str), "a model type such as qwen3_moe"),
                            ("policy", lambda v: isinstance(v, str), "a policy name such as sparse-first"),
                            ("budget_bytes", _COUNT, "a number of bytes, an int >= 0"),
                            ("batch", lambda v: _INT(v) and v >= 1, "the sequences decoded together, an int >= 1"),
                            ("tensors", lambda v: isinstance(v, list), "a list of tensor objects")):
        if field not in data:
            raise ValueError(f"field {field!r} is missing; it must be {want}")
        if not ok(data[field]):
            raise _field_error("the plan", field, data[field], want)
    for field, ok, want in (
            ("offload_params", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
             "a list of selectors"),
            ("notes", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
            ("host_budget_bytes", lambda v: v is None or _COUNT(v), "a number of bytes >= 0, or null"),
            ("expert_densities", _densities_ok, "an object: layer -> per expert a probability in [0, 1]")):
        if field in data and not ok(data[field]):
            raise _field_error("the plan", field, data[field], want)
    fields = dict(model_type=data["model_type"], policy=data["policy"], budget_bytes=data["budget_bytes"],
                  batch=data["batch"], offload_params=tuple(data.get("offload_params", ())),
                  notes=tuple(data.get("notes", ())),
                  expert_densities=tuple((int(layer), tuple(float(x) for x in p))
                                         for layer, p in data.get("expert_densities", {}).items()),
                  host_budget_bytes=data.get("host_budget_bytes"))
    return fields, [read_tensor(t, i) for i, t in enumerate(data["tensors"])]


def _densities_ok(v) -> bool:
    return isinstance(v, dict) and all(
        isinstance(layer, str) and layer.isdigit() and isinstance(p, list)
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and 0 <= x <= 1
                for x in p)
        for layer, p in v.items())
