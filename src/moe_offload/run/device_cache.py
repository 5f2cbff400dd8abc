"""The device-side expert cache, runtime side: where a decode step reads each selected offloaded expert from.

`load(cache_gb=X, cache_policy=P)` gives the runtime a `DeviceCache`: device memory carved once, at
load, for offloaded routed experts that decode steps fetched, run by one policy object of
cache_policy.py (the very objects `replay` drives, so the runtime's decisions are replay's).

Which calls: decode steps only (one new token per sequence on a non-empty KV cache, the steps the
LinkCounter's bytes per decoded token and a trace's `decode` rows are made of). A prefill reads its
experts as without a cache and leaves the cache as it was: `replay` replays decode tokens, and a
prompt's experts say little about the next tokens'.

Order of accesses, as replay makes them: per step, layer by layer as the model runs them, per layer
`policy.access((layer, expert), nbytes)` for each selected expert with offloaded bytes, ascending ids;
nbytes is the expert's offloaded bytes over all its layer's fused tensors (accounting.TokenBytes).

Memory: one arena of `pages x page_bytes` bytes (uint8 [pages, page_bytes]), where page_bytes is the
greatest common divisor of the row bytes (one expert's slice) of every offloaded routed tensor. An
admitted expert takes nbytes / page_bytes free pages, wherever they are, one run per tensor row. Every
expert's bytes are a whole number of pages, so whatever set of experts the policy holds within
capacity_bytes fits in capacity_bytes // page_bytes pages: no fragmentation, whatever the mix of sizes
(tensors split between tiers give experts of different sizes). The arena is capacity_bytes rounded down
to whole pages, and never more than every offloaded expert together; it never exceeds the cache size.

Reads, for one layer step (both backends; decided by `decide`, pages.PagedCache's, in the layer step's read
plan, read_plan.py, and copied by its executor, read_executor.py; the gathered order stays ascending by expert id,
so the eager loop's arithmetic is the model's own):
    resident stack (a split tensor's device experts)  device-local gather, no link bytes
    hit                                               device-local gather from its pages, no link bytes
    miss                                              read from the host over the link (the counted bytes), or
                                                      taken from the rows the look-ahead copied ahead (lookahead.py);
                                                      when the policy admits it, its row is then copied from
                                                      the staged buffer into its pages (device-local)
    miss of a disk-tier tensor's expert               read below the cache as without it (the host cache, the
                                                      look-ahead's rows, or the checkpoint), then admitted the
                                                      same way

The cache holds offloaded experts of both tiers (host and disk): a policy's nbytes is the expert's bytes over
every offloaded tensor of its layer, as replay's device level counts them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping, NoReturn

import torch

from ..routing.cache_policy import DEFAULT_CACHE_POLICY, make_cache
from ..errors import BudgetError, MoeOffloadError, SelectorError
from ..planning.planner import DEFAULT_RESERVE_GB
from ..planning.placement import GiB, format_bytes

from .experts import ExpertsState
from .pages import PagedCache


Key = tuple[int, int]  # (layer, expert)


def cache_options(cache_gb, cache_policy: str | None) -> tuple[int, str]:
    """(capacity in bytes, policy name) for load's cache_gb / cache_policy, checked; capacity 0 is no cache.

    The policy is checked even for a zero size, so a misspelt one fails before anything loads."""
    if cache_gb is None:
        if cache_policy is not None:
            raise SelectorError(f"cache_policy={cache_policy} without cache_gb: give the cache size too, "
                                "e.g. cache_gb=1")
        return 0, DEFAULT_CACHE_POLICY
    if isinstance(cache_gb, bool) or not isinstance(cache_gb, (int, float)) or not math.isfinite(cache_gb) \
            or cache_gb < 0:
        raise BudgetError(f"cache_gb={cache_gb} is not a size: give a non-negative number of GiB "
                          "(0, the default, is no cache)")
    policy = cache_policy or DEFAULT_CACHE_POLICY
    make_cache(policy, 0)  # unknown names and belady (replay only) are refused here, with the choices
    return int(cache_gb * GiB), policy   # whole bytes, as replay counts them: never above cache_gb


def check_capacity(capacity: int, plan) -> None:
    """Refuse, before anything loads, a non-zero cache that cannot hold the plan's largest offloaded expert
    (the policy could never admit it); a plan that offloads no routed expert leaves the cache empty."""
    if not capacity:
        return
    tb = plan.token_bytes()
    per_expert = tb.expert_host + tb.expert_disk        # [routed layers, E] offloaded bytes
    if per_expert.size and int(per_expert.max()) > capacity:
        row, e = divmod(int(per_expert.argmax()), per_expert.shape[1])
        _too_small(capacity, int(per_expert.max()), tb.layers[row], e)


def _too_small(capacity: int, nbytes: int, layer: int, expert: int) -> NoReturn:
    raise BudgetError(f"cache_gb={capacity / GiB:.6g} ({capacity} bytes) cannot hold one expert: expert {expert} of "
                      f"layer {layer} has {nbytes} offloaded bytes; give at least cache_gb={nbytes / GiB:.6g}, or 0 "
                      "for no cache")


def reserve_note(capacity: int, policy: str, device_memory_gb: float | None, reserve_gb: float | None,
                 process: int = 0) -> str | None:
    """With device_memory_gb the cache is taken out of the reserve: the plan note, or BudgetError if it does not
    fit there (`process`: on a CPU-only machine the process's own bytes, measured, which the reserve holds too).
    None without device_memory_gb (the cache is then device memory on top of the resident weights)."""
    if device_memory_gb is None or not capacity:
        return None
    reserve = reserve_gb if reserve_gb is not None else DEFAULT_RESERVE_GB
    room = math.floor(reserve * GiB) - process
    if capacity > room:
        beside = f" beside the process itself ({format_bytes(process)}, measured)" if process else ""
        raise BudgetError(f"cache_gb={capacity / GiB:g} does not fit in the {reserve:g} GiB reserve{beside} "
                          f"({format_bytes(capacity)} > {format_bytes(max(room, 0))}): with device_memory_gb the "
                          "cache is taken out of the reserve kept for activations and the KV cache; give a larger "
                          f"reserve_gb (at least {capacity / GiB:g} plus room for activations) or a smaller cache")
    return (f"the device-side expert cache ({format_bytes(capacity)}, {policy}) is taken out of the {reserve:g} GiB "
            f"reserve: {format_bytes(room - capacity)} of it remain for activations and the KV cache")


@dataclass(frozen=True)
class _Layer:
    """One experts module's offloaded tensors, as the cache sees them."""

    layer: int
    module: str                             # its dotted name (for invalidation by tensor name)
    names: tuple[str, ...]                  # offloaded tensors (local names): host tier, then disk tier
    on_disk: tuple[bool, ...]               # per tensor: a disk-tier tensor (read through disk_tier.py)
    row_bytes: tuple[int, ...]              # per tensor: bytes of one expert's slice
    host_row: tuple[tuple[int | None, ...], ...]      # per tensor, per expert: its row in the host stack or None
    resident_row: tuple[tuple[int | None, ...], ...]  # per tensor, per expert: its row in the resident stack or None
    nbytes: tuple[int, ...]                 # per expert: offloaded bytes over every tensor (0: resident in all)

    def row_bytes_of(self, expert: int) -> list[int]:
        return [b if rows[expert] is not None else 0 for b, rows in zip(self.row_bytes, self.host_row)]


def _layout(module: str, state: ExpertsState) -> _Layer:
    names, disk, row_bytes, host_rows, resident_rows = [], [], [], [], []
    experts = state.num_experts
    tensors = [(n, t.shape[0], t[0].numel() * t.element_size(), False) for n, t in state.offloaded.items()]
    tensors += [(n, src.experts, src.row_bytes, True) for n, src in state.disk.items() if src.experts is not None]
    for name, count, nbytes, is_disk in tensors:
        split = state.split.get(name)
        host_ids = split.host_ids if split is not None else tuple(range(count))   # a disk split: its disk ids
        resident_ids = split.resident_ids if split is not None else ()
        host = [None] * experts
        for row, e in enumerate(host_ids):
            host[e] = row
        resident = [None] * experts
        for row, e in enumerate(resident_ids):
            resident[e] = row
        names.append(name)
        disk.append(is_disk)
        row_bytes.append(nbytes)
        host_rows.append(tuple(host))
        resident_rows.append(tuple(resident))
    nbytes = tuple(sum(b for b, rows in zip(row_bytes, host_rows) if rows[e] is not None) for e in range(experts))
    return _Layer(state.layer, module, tuple(names), tuple(disk), tuple(row_bytes), tuple(host_rows),
                  tuple(resident_rows), nbytes)


class DeviceCache(PagedCache):
    """Offloaded routed experts kept on the device, in pages carved once, under one cache policy."""

    @property
    def _pages(self) -> dict[Key, tuple[list[int], ...]]:   # resident key -> per tensor of its layer, its pages
        return self.pages.held

    @property
    def _free(self) -> list[int]:
        return self.pages.free

    # --- layout ------------------------------------------------------------------------------
    def attach(self, states: Mapping[str, ExpertsState], device: torch.device) -> None:
        """Lay the cache out over the experts modules' offloaded tensors (module name -> state); carves the arena
        the first time, and again only when a transform changed the row sizes. Anything cached is dropped: it
        was copied from the weights as they were before."""
        self.drop_all()
        layers: dict[int, _Layer] = {}
        for module, state in states.items():
            if state.layer is None or not (state.offloaded or state.disk):
                continue
            if state.layer in layers:
                raise MoeOffloadError(f"{module} and {layers[state.layer].module} are two experts modules of layer "
                                      f"{state.layer} with offloaded experts; the device-side cache keys experts by "
                                      "(layer, expert), as traces and replay do: load without cache_gb")
            layers[state.layer] = _layout(module, state)
        self._layers = layers
        biggest = max(((n, lay.layer, e) for lay in layers.values() for e, n in enumerate(lay.nbytes)), default=None)
        if biggest is not None and biggest[0] > self.capacity_bytes:   # check_capacity refused it from the plan
            _too_small(self.capacity_bytes, *biggest)                  # already, unless transformed
        self.pages.carve([b for lay in layers.values() for b in lay.row_bytes],
                         [n for lay in layers.values() for n in lay.nbytes], self.capacity_bytes, device)

    @property
    def device_bytes(self) -> int:
        """Device memory the cache holds: its arena."""
        return self.pages.nbytes

    # --- contents ----------------------------------------------------------------------------
    def invalidate(self, names: Iterable[str] | None = None) -> list[Key]:
        """Drop the cached copies of experts of these tensors (dotted names; None: all); returns the keys dropped."""
        if names is None:
            dropped = list(self._pages)
            self.drop_all()
            return dropped
        by_module = {lay.module: lay for lay in self._layers.values()}
        dropped = []
        for name in names:
            module, _, local = name.rpartition(".")
            lay = by_module.get(module)
            if lay is None or local not in lay.names:
                continue
            rows = lay.host_row[lay.names.index(local)]
            for e, row in enumerate(rows):
                key = (lay.layer, e)
                if row is not None and key in self._pages:
                    self.policy.invalidate(key)
                    self.pages.release(key)
                    dropped.append(key)
        return dropped

    def stats(self) -> dict:
        return {"cache_policy": self.policy_name, "cache_bytes": self.capacity_bytes, "cache_hits": self.policy.hits,
                "cache_misses": self.policy.misses, "cache_evictions": self.policy.evictions,
                "cache_declined": self.policy.declined, "cache_device_bytes": self.device_bytes,
                "cache_page_bytes": self.page_bytes}

def cache_stats(cache: DeviceCache | None) -> dict:
    """The cache's counts for reports (generate --json, bench rows); without a cache: no policy, all zeros."""
    if cache is None:
        return {"cache_policy": None, "cache_bytes": 0, "cache_hits": 0, "cache_misses": 0, "cache_evictions": 0,
                "cache_declined": 0, "cache_device_bytes": 0, "cache_page_bytes": 0}
    return cache.stats()
