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
from .roles import Role

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


def format_bytes(n: float) -> str:
    """Bytes for people: GiB, MiB or KiB with 2 decimals (powers of 2), or plain bytes."""
    for unit, size in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"
