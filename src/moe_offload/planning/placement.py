"""What a plan is: the tier of every tensor, as data. No policy lives here (planner.py decides).

A `Plan` is printable, saved to and loaded from JSON, diffable; every module after the
planner (loader, runtime, audit, replay, export) reads placements through these types.
Sizes are int bytes; GiB appears only in `format_bytes` and at the CLI.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from enum import Enum

from .accounting import TokenBytes
from ..model.roles import Role

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
    # A routed-expert tensor [E, ...] split by expert. `tier` is the furthest tier any of its bytes lies in, so
    # `tier != "device"` means "offloaded, at least in part" and `tier == "disk"` means "the runtime reads some
    # of it from the checkpoint". host_experts / host_expert_ids: the experts OFF THE DEVICE (the name is from
    # the two-tier plans, where that was the host), lying in `tier`; the others are on the device. The count
    # alone means the last `host_experts` experts (sparse-first); the ids (ascending) any subset (frequency).
    # Neither: the tensor lies whole in its tier.
    host_experts: int = 0
    host_expert_ids: tuple[int, ...] = ()
    # Only when a tensor's offloaded experts span host AND disk: the ascending ids of those on disk (a subset
    # of host_ids; the rest of host_ids are in host memory); tier is then "disk". Empty: all in `tier`.
    disk_expert_ids: tuple[int, ...] = ()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def host_ids(self) -> tuple[int, ...]:
        """Ids of the experts of a split tensor that are off the device (ascending); () for a whole tensor."""
        if self.host_expert_ids:
            return self.host_expert_ids
        if self.host_experts:
            return tuple(range(self.shape[0] - self.host_experts, self.shape[0]))
        return ()

    @property
    def disk_ids(self) -> tuple[int, ...]:
        """Ids of the experts of a split tensor that lie on disk (ascending); () for a whole tensor."""
        if self.tier != Tier.DISK:
            return ()
        return self.disk_expert_ids or self.host_ids

    @property
    def memory_ids(self) -> tuple[int, ...]:
        """Ids of the experts of a split tensor that lie in host memory (ascending); () for a whole tensor."""
        disk = set(self.disk_ids)
        return tuple(e for e in self.host_ids if e not in disk)

    @property
    def resident_experts(self) -> int:
        """How many experts of a split tensor stay on the device (0 for a whole tensor)."""
        return self.shape[0] - len(self.host_ids) if self.host_ids else 0

    @property
    def offloaded_bytes(self) -> int:
        """Bytes off the device: in host memory or on disk."""
        if self.tier == Tier.DEVICE:
            return 0
        if self.host_experts:
            return self.bytes // self.shape[0] * self.host_experts
        return self.bytes

    @property
    def disk_bytes(self) -> int:
        """Bytes on disk: read from the checkpoint at run time."""
        if self.tier != Tier.DISK:
            return 0
        return self.bytes // self.shape[0] * len(self.disk_ids) if self.host_ids else self.bytes

    @property
    def host_bytes(self) -> int:
        """Bytes in host memory."""
        return self.offloaded_bytes - self.disk_bytes

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
    def from_json(cls, text: str) -> "Plan":
        from ..errors import MoeOffloadError

        try:
            data = json.loads(text)
            if data.get("format") != PLAN_FORMAT:
                raise ValueError(f"plan format {data.get('format')!r}, this moe-offload reads format {PLAN_FORMAT}")
            tensors = tuple(PlannedTensor(**{**t, "shape": tuple(t["shape"]), "tier": Tier(t["tier"]).value,
                                             "host_expert_ids": tuple(t.get("host_expert_ids", ())),
                                             "disk_expert_ids": tuple(t.get("disk_expert_ids", ()))})
                            for t in data["tensors"])
            for t in tensors:
                _check_tiers(t)
            densities = tuple((int(layer), tuple(float(x) for x in p))
                              for layer, p in data.get("expert_densities", {}).items())
            host_budget = data.get("host_budget_bytes")
            return cls(tensors, data["model_type"], data["policy"], int(data["budget_bytes"]), int(data["batch"]),
                       tuple(data.get("offload_params", ())), tuple(data.get("notes", ())), densities,
                       None if host_budget is None else int(host_budget))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise MoeOffloadError(f"not a moe-offload plan ({type(exc).__name__}: {exc}); save one with "
                                  "`moe-offload plan --save PLAN.json`") from exc


def _check_tiers(t: PlannedTensor) -> None:
    """A saved tensor's experts must each lie in one tier (ValueError: from_json makes it a user error)."""
    if not t.disk_expert_ids:
        return
    disk, e = tuple(t.disk_expert_ids), t.shape[0] if t.shape else 0
    where = f"tensor {t.name}: disk_expert_ids {list(disk)[:8]}"
    if t.tier != Tier.DISK:
        raise ValueError(f"{where} with tier {t.tier!r}; a tensor with experts on disk has tier 'disk'")
    if list(disk) != sorted(set(disk)) or disk[0] < 0 or disk[-1] >= e:
        raise ValueError(f"{where}: expert ids must be ascending, distinct and below {e}")
    stray = sorted(set(disk) - set(t.host_ids))
    if stray:
        raise ValueError(f"{where}: experts {stray[:8]} are not among the experts off the device (host_experts / "
                         "host_expert_ids); disk_expert_ids names the part of those on disk")


def format_bytes(n: float) -> str:
    """Bytes for people: GiB, MiB or KiB with 2 decimals (powers of 2), or plain bytes."""
    for unit, size in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"
