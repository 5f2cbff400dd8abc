"""The one definition of the bytes a decoded token reads from each tier (docs/design.md, "Accounting").

The planner's estimate (Plan.link_bytes_per_token), `replay` and the runtime's LinkCounter all
count the same thing. At batch 1 a decode token reads, from the tier where each lies:

    every offloaded dense tensor of the language model, in full (towers run at prefill only)
    one row of every offloaded lookup table (the input embedding)
    of each fused routed-expert tensor [E, ...]: bytes // E for every expert it picked that is offloaded

so a token's bytes are `dense + sum over layers of expert_bytes[layer][picked]`. The expected
value follows from the probability that a token reads each expert: k/E under uniform routing,
or measured frequencies; at batch b a step reads an expert when any of its b tokens picks it
(1 - (1 - p)^b, tokens taken as independent) and the step's bytes are shared by b tokens.

Each byte is read from the tier it lies in, and counted there: a tensor on disk is read from the
checkpoint (dense ones in full, lookup tables by the row), and each expert of a tensor split by
expert from its own tier (PlannedTensor: host_ids are off the device, in the tensor's tier; a disk
tensor's disk_expert_ids are the part of them on disk). A device-side cache hit reads nothing from
either tier.

This module takes PlannedTensor-like objects (name, shape, bytes, layer, component, role, tier,
experts, top_k, offloaded_bytes, host_ids, optionally disk_expert_ids) and never imports the planner: the
planner imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Protocol, Sequence

import numpy as np

HOST, DISK = "host", "disk"
_ROUTED, _EMBEDDING = "routed_expert", "embedding"


class TensorLike(Protocol):
    name: str
    shape: tuple[int, ...]
    bytes: int
    layer: int | None
    component: str
    role: str
    tier: str
    experts: int | None
    top_k: int | None

    @property
    def offloaded_bytes(self) -> int: ...

    @property
    def host_ids(self) -> tuple[int, ...]: ...

    # Optional (absent: none): the subset of host_ids on disk when a tensor's offloaded experts span host and disk.
    # disk_expert_ids: tuple[int, ...]


def expert_ids_by_tier(t: TensorLike) -> dict[str, tuple[int, ...]]:
    """{tier: the expert ids of routed tensor t that lie there}, for the offloaded tiers holding any of them.

    host_ids are the experts of a split tensor off the device (none: all E, a tensor that went whole), in the
    tensor's tier; a disk tensor's disk_expert_ids, when given, are the part of them on disk and the rest are in
    host memory."""
    if t.tier not in (HOST, DISK) or t.role != _ROUTED or not t.experts:
        return {}
    off = tuple(t.host_ids) or tuple(range(t.experts))
    if t.tier == HOST:
        return {HOST: off}
    disk = set(getattr(t, "disk_expert_ids", ()) or off)
    split = {HOST: tuple(e for e in off if e not in disk), DISK: tuple(e for e in off if e in disk)}
    return {tier: ids for tier, ids in split.items() if ids}


def expert_ids_offloaded(t: TensorLike) -> tuple[int, ...]:
    """The expert ids whose slice of a routed tensor is offloaded (host or disk), ascending."""
    return tuple(sorted(e for ids in expert_ids_by_tier(t).values() for e in ids))


def expert_slice_bytes(t: TensorLike) -> int:
    """Bytes of one expert of a routed tensor: what the runtime moves per selected expert (`t[e]`)."""
    return t.bytes // t.experts


@dataclass(frozen=True, eq=False)
class TokenBytes:
    """Per-tier bytes a decoded token reads, for one placement.

    layers: the routed layers, ascending (the `layers` of a matching trace header);
    expert_host / expert_disk: int64 [len(layers), E], offloaded bytes of each expert of each layer;
    dense_host / dense_disk: bytes every decode token reads whatever it routes (batch 1).
    """

    layers: tuple[int, ...]
    num_experts: int
    top_k: int
    expert_host: np.ndarray
    expert_disk: np.ndarray
    dense_host: int
    dense_disk: int
    # (tier, kind, offloaded bytes, rows or experts, top_k) per offloaded language tensor, for expectations
    _terms: tuple[tuple[str, str, int, int, int], ...] = ()

    @classmethod
    def of(cls, tensors: Iterable[TensorLike]) -> "TokenBytes":
        tensors = list(tensors)
        routed = [t for t in tensors if t.role == _ROUTED and t.experts and t.layer is not None]
        layers = tuple(sorted({t.layer for t in routed}))
        e = max((t.experts for t in routed), default=0)
        k = max((t.top_k or 0 for t in routed), default=0)
        row = {layer: i for i, layer in enumerate(layers)}
        expert = {HOST: np.zeros((len(layers), e), dtype=np.int64), DISK: np.zeros((len(layers), e), dtype=np.int64)}
        dense = {HOST: 0, DISK: 0}
        terms = []
        for t in tensors:
            if t.tier not in (HOST, DISK) or t.component != "language":
                continue   # resident, or a tower that runs at prefill only: a decoded token reads none of it
            if t.role == _ROUTED and t.experts and t.layer is not None:
                by_tier = expert_ids_by_tier(t)
                for tier, ids in by_tier.items():
                    expert[tier][row[t.layer], list(ids)] += expert_slice_bytes(t)
                    part = t.offloaded_bytes if len(by_tier) == 1 else expert_slice_bytes(t) * len(ids)
                    terms.append((tier, _ROUTED, part, t.experts, t.top_k or 0))
            elif t.role == _EMBEDDING and t.shape:
                dense[t.tier] += t.bytes // t.shape[0]     # one row per decoded token
                terms.append((t.tier, _EMBEDDING, t.offloaded_bytes, t.shape[0], 0))
            else:
                dense[t.tier] += t.offloaded_bytes
                terms.append((t.tier, "dense", t.offloaded_bytes, 1, 0))
        return cls(layers, e, k, expert[HOST], expert[DISK], dense[HOST], dense[DISK], tuple(terms))

    # --- one token ---------------------------------------------------------------------------------------
    def expert_bytes(self, layer: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(host, disk) offloaded bytes of each expert id of `layer`."""
        i = self.layers.index(layer)
        return tuple(self.expert_host[i].tolist()), tuple(self.expert_disk[i].tolist())

    def bytes_for_token(self, experts_per_layer: Mapping[int, Iterable[int]] | Sequence[Iterable[int]]
                        ) -> tuple[int, int]:
        """(host, disk) bytes one decoded token reads, given the distinct experts it picked per layer:
        a mapping layer -> ids, or one list per routed layer in `layers` order (a trace row's `experts`)."""
        pairs = experts_per_layer.items() if isinstance(experts_per_layer, Mapping) \
            else zip(self.layers, experts_per_layer, strict=True)
        host, disk = self.dense_host, self.dense_disk
        for layer, ids in pairs:
            i = self.layers.index(layer)
            ids = list(ids)
            host += int(self.expert_host[i, ids].sum())
            disk += int(self.expert_disk[i, ids].sum())
        return host, disk

    def step_bytes(self, layer: int, experts: Iterable[int], device_hits: Iterable[int] = (),
                   host_hits: Iterable[int] = (), on_host: Iterable[int] = ()) -> tuple[int, int]:
        """(host, disk) bytes one step of routed layer `layer` reads for its distinct `experts`: each expert's
        offloaded bytes from the tier that holds them; nothing for a device-cache hit (`device_hits`); the disk
        bytes of a host-cache hit (`host_hits`) from host memory, so counted as host bytes. An expert computed on the
        host (`on_host`) sends no weight over the link: its disk bytes are still read from disk (unless the host
        cache held them), its host bytes are not link bytes. The runtime charges every staged layer step with this
        (run/read_plan.py), replay sums the same arrays over a trace."""
        if layer not in self.layers:
            return 0, 0
        host_of, disk_of = self._rows(layer)
        skip, moved, local = set(device_hits), set(host_hits), set(on_host)
        ids = [e for e in experts if e not in skip]
        linked = [e for e in ids if e not in local]
        host = sum(host_of[e] for e in linked)
        disk = sum(disk_of[e] for e in ids if e not in moved)
        from_host = sum(disk_of[e] for e in linked if e in moved)
        return host + from_host, disk

    def _rows(self, layer: int) -> tuple[list[int], list[int]]:
        """(host, disk) bytes per expert of `layer` as Python lists, made once (charged at every layer step)."""
        cache = self.__dict__.setdefault("_row_lists", {})
        if layer not in cache:
            i = self.layers.index(layer)
            cache[layer] = (self.expert_host[i].tolist(), self.expert_disk[i].tolist())
        return cache[layer]

    # --- expectations ------------------------------------------------------------------------------------
    def expected(self, batch: int = 1, frequencies: Mapping[int, Sequence[float]] | None = None
                 ) -> tuple[float, float]:
        """(host, disk) expected bytes per decoded token at `batch` sequences decoded together.

        frequencies: layer -> per expert, the probability that one token picks it (sums to about
        top_k per layer); None: uniform routing, k/E each. Lookup tables: min(b, rows) rows per step.
        """
        b = batch
        if frequencies is not None:
            p = np.array([frequencies[layer] for layer in self.layers], dtype=np.float64).reshape(
                len(self.layers), self.num_experts)
            step = 1.0 - (1.0 - np.clip(p, 0.0, 1.0)) ** b
        out = {HOST: 0.0, DISK: 0.0}
        for tier, kind, nbytes, n, k in self._terms:
            if kind == _ROUTED and frequencies is None:
                out[tier] += nbytes * (1.0 - (1.0 - k / n) ** b)
            elif kind == _EMBEDDING:
                out[tier] += nbytes * (min(b, n) / n)
            elif kind == "dense":
                out[tier] += nbytes
        if frequencies is not None:
            out[HOST] += float((self.expert_host * step).sum())
            out[DISK] += float((self.expert_disk * step).sum())
        return out[HOST] / b, out[DISK] / b

    def expected_total(self, batch: int = 1, frequencies: Mapping[int, Sequence[float]] | None = None) -> float:
        host, disk = self.expected(batch, frequencies)
        return host + disk
