"""What a plan is: the tier of every tensor, as data. No policy lives here (planner.py decides).

A `Plan` is printable, saved to and loaded from JSON (plan_json.py reads it back), diffable; every
module after the planner (loader, runtime, audit, replay, export) reads placements through these types.
Sizes are int bytes; GiB appears only in `format_bytes` and at the CLI.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from enum import Enum

from .accounting import TokenBytes
from .density import access_density
from ..model.roles import Role
from .plan_json import read_plan

GiB = 1 << 30
PLAN_FORMAT = 1


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
    # A routed-expert tensor [E, ...] by expert. `tier` is the furthest tier any of its bytes lies in, so
    # `tier != "device"` means "offloaded, at least in part" and `tier == "disk"` means "the runtime reads some
    # of it from the checkpoint". host_expert_ids: the ids (ascending) of the experts OFF THE DEVICE (the name
    # is from the two-tier plans, where that was the host), lying in `tier`; the others are on the device.
    # Every offloaded tensor with an expert axis lists them, under every policy: some of its ids when it went
    # in part, all E when whole (a whole tensor, not a split). host_experts: exactly their count. A tensor
    # without an expert axis lists none and lies whole in its tier. (Built in Python, a count alone still
    # means its last `host_experts` experts, as plans saved before the ids did; from_json writes the ids.)
    host_experts: int = 0
    host_expert_ids: tuple[int, ...] = ()
    # Only when a tensor's offloaded experts span host AND disk: the ascending ids of those on disk (a subset
    # of host_ids; the rest of host_ids are in host memory); tier is then "disk". Empty: all in `tier`.
    disk_expert_ids: tuple[int, ...] = ()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def offloaded_ids(self) -> tuple[int, ...]:
        """Ids of the experts off the device, as the tensor lists them (ascending): all E for a whole offloaded
        tensor with an expert axis; () for a resident tensor or one without an expert axis."""
        if self.host_expert_ids:
            return self.host_expert_ids
        if self.host_experts:
            return tuple(range(self.shape[0] - self.host_experts, self.shape[0]))
        return ()

    @property
    def host_ids(self) -> tuple[int, ...]:
        """Ids of the experts of a split tensor that are off the device (ascending); () for a whole tensor (one
        that lists all of its experts is whole, not split)."""
        ids = self.offloaded_ids
        return ids if len(ids) < self.shape[0] else ()

    @property
    def is_split(self) -> bool:
        """Split by expert between the device and an offloaded tier: some of its experts off the device."""
        return bool(self.host_ids)

    @property
    def disk_ids(self) -> tuple[int, ...]:
        """Ids of the experts of a split tensor, or of a tensor whose offloaded experts span host and disk, that
        lie on disk (ascending); () for a tensor whole on disk."""
        if self.tier != Tier.DISK:
            return ()
        return self.disk_expert_ids or self.host_ids

    @property
    def memory_ids(self) -> tuple[int, ...]:
        """Ids of the experts of a split tensor, or of a tensor whose offloaded experts span host and disk, that
        lie in host memory (ascending); () for a whole tensor in one tier."""
        disk = set(self.disk_ids)
        return tuple(e for e in (self.offloaded_ids if self.disk_expert_ids else self.host_ids) if e not in disk)

    @property
    def resident_experts(self) -> int:
        """How many experts of a split tensor stay on the device (0 for a whole tensor)."""
        return self.shape[0] - len(self.host_ids) if self.host_ids else 0

    @property
    def offloaded_bytes(self) -> int:
        """Bytes off the device: in host memory or on disk."""
        if self.tier == Tier.DEVICE:
            return 0
        return self.bytes // self.shape[0] * len(self.host_ids) if self.host_ids else self.bytes

    @property
    def disk_bytes(self) -> int:
        """Bytes on disk: read from the checkpoint at run time."""
        if self.tier != Tier.DISK:
            return 0
        part = 0 < len(self.disk_ids) < self.shape[0]
        return self.bytes // self.shape[0] * len(self.disk_ids) if part else self.bytes

    @property
    def host_bytes(self) -> int:
        """Bytes in host memory."""
        return self.offloaded_bytes - self.disk_bytes

    def density(self, batch: int = 1) -> float:
        """Expected fraction of this tensor's bytes read by one decode step of `batch` sequences (density.py)."""
        return access_density(self.role, self.shape, self.experts, self.top_k, batch)


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
    # The host tier's capacity the plan was made for (host_memory_gb, or 0 on a CPU-only machine with
    # device_memory_gb alone); what left the device beyond it is on disk. None: the host tier is unbounded.
    host_budget_bytes: int | None = None

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
    def disk_bytes(self) -> int:
        return sum(t.disk_bytes for t in self.tensors)

    @property
    def host_bytes(self) -> int:
        """Bytes in the host tier (offloaded_bytes = host_bytes + disk_bytes)."""
        return self.offloaded_bytes - self.disk_bytes

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

    def link_bytes_by_tier(self, batch: int | None = None) -> tuple[float, float]:
        """(host, disk): expected bytes per decoded token read from host memory and from disk; they sum to
        link_bytes_per_token."""
        return self.token_bytes().expected(batch or self.batch, self.frequencies)

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
        host_link, disk_read = self.link_bytes_by_tier()
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
            "host_bytes": self.host_bytes,
            "disk_bytes": self.disk_bytes,
            "host_budget_bytes": self.host_budget_bytes,
            "link_bytes_per_token": host_link + disk_read,
            "host_link_bytes_per_token": host_link,
            "disk_read_bytes_per_token": disk_read,
            "roles": self.roles(),
            "tensors": [dict(asdict(t), shape=list(t.shape)) for t in self.tensors],
            "notes": list(self.notes),
            "expert_densities": {str(layer): list(p) for layer, p in self.expert_densities},
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str, *, source: str | None = None) -> "Plan":
        """A saved plan, every field's type checked and older forms read as today's (plan_json.py); whether it
        fits a model is plan_check.check_plan's question."""
        from ..errors import MoeOffloadError

        try:
            fields, tensors = read_plan(json.loads(text), PLAN_FORMAT)
            tensors = tuple(PlannedTensor(**t) for t in tensors)
            for t in tensors:
                problem = expert_tier_problem(t)
                if problem:
                    raise ValueError(problem)
            return cls(tensors, **fields)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
            what = f"{source} is not" if source else "not"
            raise MoeOffloadError(f"{what} a moe-offload plan ({type(exc).__name__}: {exc}); save one with "
                                  "`moe-offload plan MODEL --save PLAN.json`") from exc


def expert_tier_problem(t: PlannedTensor) -> str | None:
    """What is wrong with where a tensor's experts lie, if anything: each must lie in one tier."""
    if not t.disk_expert_ids:
        return None
    disk, e = tuple(t.disk_expert_ids), t.shape[0] if t.shape else 0
    where = f"tensor {t.name}: disk_expert_ids {list(disk)[:8]}"
    if t.tier != Tier.DISK:
        return f"{where} with tier {t.tier!r}; a tensor with experts on disk has tier 'disk'"
    if list(disk) != sorted(set(disk)) or disk[0] < 0 or disk[-1] >= e:
        return f"{where}: expert ids must be ascending, distinct and below {e}"
    stray = sorted(set(disk) - set(t.offloaded_ids))
    if stray:
        return (f"{where}: experts {stray[:8]} are not among the experts off the device (host_experts / "
                "host_expert_ids); disk_expert_ids names the part of those on disk")
    return None


def format_bytes(n: float) -> str:
    """Bytes for people: GiB, MiB or KiB with 2 decimals (powers of 2), or plain bytes."""
    for unit, size in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"
