"""The host-memory cache of disk-tier experts: a disk expert read once stays in RAM while its policy keeps it.

`load(host_cache_gb=X, cache_policy=P)` gives the runtime a `HostCache`: host memory carved once, at load,
out of the host budget, for routed experts that the plan leaves on the disk tier, run by one policy object
of cache_policy.py (the objects the device cache and `replay` drive: `--cache-policy` names the policy of
both levels; one policy for both is right here because the two levels see the same access sequence, the
host cache only its disk part).

Which calls: decode steps look experts up, as the device cache does. A prefill reads as without it (no hit, no
miss, every disk expert from disk), but what it read may stay: per layer, the experts its tokens picked most
(expert_cache.prefill_keeps) are stored in pages still free, within the layer's share of the capacity (capacity //
layers served), evicting nothing (policy.preload). The first decoded token then finds its experts in host memory
instead of reading again what the prefill had just read (Qwen3-30B-A3B x 8 at a 55% cap: 475 MB). Replay does the
same with the trace's prefill rows.
Order of accesses, as replay makes them: per decode step, layer by layer, per layer the selected experts
with disk bytes in ascending id, `policy.access((layer, expert), nbytes)`, nbytes the expert's bytes over
every disk-tier tensor of its layer.

Reads, for one layer step (planned by read_plan.py, copied by read_executor.py):
    hit        its rows copied from the cache's pages (host memory): counted as host-link bytes, no disk read; a
               CPU-only streamed decode step (streamed.py) reads a row whose pages are one run in place instead
    miss       read from the checkpoint (counted as disk bytes); admitted by the policy, its rows are then
               copied into pages it claimed (victims' pages freed first); a streamed step reads a row whose
               claimed pages are one run straight into them

Memory: one arena of `pages x page_bytes` (uint8; pages.py, the device cache's arena too, here in host memory),
page_bytes the gcd of every disk-tier expert row, so any set of experts within capacity_bytes fits without
fragmentation. Carved zeroed: every page is touched at load, not by the first admission on the decode path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch

from ..errors import BudgetError
from ..planning.placement import format_bytes
from ..routing.expert_cache import prefill_keeps
from ..storage.clib import copy_bytes
from ..storage.host import expert_runs
from .pages import Decision, PagedCache

Key = tuple[int, int]   # (layer, expert)


@dataclass(frozen=True)
class _Layer:
    """One experts module's disk-tier tensors, as the host cache sees them."""

    layer: int
    names: tuple[str, ...]                    # disk-tier tensors (local names)
    row_bytes: tuple[int, ...]                # per tensor: one expert's bytes
    on_disk: tuple[tuple[bool, ...], ...]     # per tensor, per expert: is that expert on disk
    nbytes: tuple[int, ...]                   # per expert: its disk bytes over every tensor of the layer

    def row_bytes_of(self, expert: int) -> list[int]:
        return [b if d[expert] else 0 for b, d in zip(self.row_bytes, self.on_disk)]


class HostCache(PagedCache):
    """Disk-tier routed experts kept in host memory, in pages carved once, under one cache policy."""

    def attach(self, states: Mapping[str, object]) -> None:
        """Lay the cache out over the experts modules' disk-tier tensors (module name -> experts.ExpertsState)."""
        self.drop_all()
        layers: dict[int, _Layer] = {}
        for state in states.values():
            if state.layer is None or not state.disk:
                continue
            names, rows, disk = [], [], []
            for name, src in state.disk.items():
                if src.experts is None:
                    continue
                split = state.split.get(name)
                ids = set(split.host_ids) if split is not None else set(range(src.experts))
                names.append(name)
                rows.append(src.row_bytes)
                disk.append(tuple(e in ids for e in range(src.experts)))
            if names:
                n = len(disk[0])
                nbytes = tuple(sum(b for b, d in zip(rows, disk) if d[e]) for e in range(n))
                layers[state.layer] = _Layer(state.layer, tuple(names), tuple(rows), tuple(disk), nbytes)
        self._layers = layers
        biggest = max(((n, lay.layer, e) for lay in layers.values() for e, n in enumerate(lay.nbytes)), default=None)
        if biggest is not None and biggest[0] > self.capacity_bytes:
            raise BudgetError(f"a host cache of {format_bytes(self.capacity_bytes)} cannot hold one disk expert "
                              f"(layer {biggest[1]}, expert {biggest[2]}: {format_bytes(biggest[0])}); give "
                              f"--host-cache-gb of at least {biggest[0] / (1 << 30):.4g}, or 0 for none")
        self.pages.carve([b for lay in layers.values() for b in lay.row_bytes],
                         [n for lay in layers.values() for n in lay.nbytes], self.capacity_bytes)
        self._stack_views: dict[tuple, torch.Tensor] = {}    # stack_view's, of this arena

    @property
    def host_bytes(self) -> int:
        return self.pages.nbytes

    # --- contents ----------------------------------------------------------------------------
    def stats(self) -> dict:
        return {"host_cache_policy": self.policy_name, "host_cache_bytes": self.capacity_bytes,
                "host_cache_hits": self.policy.hits, "host_cache_misses": self.policy.misses,
                "host_cache_evictions": self.policy.evictions, "host_cache_host_bytes": self.host_bytes}

    # --- what a prefill leaves (the read plan asks; the executor stores the rows it reads into the pages) ----------
    def prefill_keeps(self, layer: int, slots) -> frozenset:
        """The experts of `layer` a prefill whose (token, slot) pairs picked `slots` leaves here (module docstring)."""
        lay = self._layers[layer]
        picks = [0] * len(lay.nbytes)
        for e in slots:
            picks[e] += 1
        return frozenset(prefill_keeps(picks, lay.nbytes, self.policy.prefill_room(len(self._layers))))

    def preload(self, layer: int, ids) -> Decision:
        """Those of `ids` (ascending) admitted into free pages, as a Decision with no hit: the read plan reads them
        from disk and the executor stores their rows into the pages claimed."""
        lay, pages = self._layers[layer], {}
        for e in ids:
            if self.policy.preload((layer, e), lay.nbytes[e]):
                pages[e] = self.pages.claim((layer, e), lay.row_bytes_of(e))
        return Decision(layer, lay.names, {}, pages)

    # --- one layer step: the read plan decides (PagedCache.decide), the executor copies ----------------------
    def read(self, pages: list[int], out_row: torch.Tensor) -> None:
        """out_row (one expert's row of one tensor, contiguous, on the cpu) <- its cached pages: one memcpy per run of
        consecutive pages (a byte tensor's index_select / index_copy_ over pages is many times slower on the cpu)."""
        row = out_row.view(-1).view(torch.uint8).view(-1, self.page_bytes)
        for at, first, n in expert_runs(pages):
            copy_bytes(row[at:at + n], self.arena[first:first + n])

    @staticmethod
    def run_start(pages: list[int]) -> int | None:
        """The first page of a row whose pages are one run of consecutive ids, else None (copied out with `read`)."""
        if not pages or any(b != a + 1 for a, b in zip(pages, pages[1:])):
            return None
        return pages[0]

    def stack_view(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """The arena as a stack of rows of `shape` [N, *shape], row i starting at page i (rows overlap; they are
        only read, and written by the reads that land in them): a row in one run of pages, stack[run_start], is read
        in place by the CPU kernels (streamed.py), and every such row of a step is one kernel call. Made once per
        arena, shape and dtype (every streamed layer step asks)."""
        key = (tuple(shape), dtype)     # emptied where the arena is carved (attach)
        if key not in self._stack_views:
            self._stack_views[key] = self._stack_view(shape, dtype)
        return self._stack_views[key]

    def _stack_view(self, shape, dtype: torch.dtype) -> torch.Tensor:
        flat = self.arena.view(-1).view(dtype)
        per_page, row = self.page_bytes // flat.element_size(), math.prod(shape)
        inner = [math.prod(shape[i + 1:]) for i in range(len(shape))]
        return flat.as_strided(((flat.numel() - row) // per_page + 1, *shape), (per_page, *inner))

    def store(self, pages: list[int], row: torch.Tensor) -> None:
        """An admitted expert's row of one tensor (contiguous, on the cpu) -> its pages."""
        src = row.reshape(-1).view(torch.uint8).view(-1, self.page_bytes)
        for at, first, n in expert_runs(pages):
            copy_bytes(self.arena[first:first + n], src[at:at + n])


def host_cache_bytes(host_cache_gb) -> int:
    """--host-cache-gb as whole bytes, checked (None or 0: no host cache)."""
    if host_cache_gb is None:
        return 0
    if isinstance(host_cache_gb, bool) or not isinstance(host_cache_gb, (int, float)) \
            or not math.isfinite(host_cache_gb) or host_cache_gb < 0:
        raise BudgetError(f"--host-cache-gb {host_cache_gb} is not a size: give a non-negative number of GiB "
                          "(0 or none: no host cache)")
    return int(host_cache_gb * (1 << 30))


def carve(capacity: int, budget: dict, planned: bool, beside: int = 0, process: int = 0) -> tuple[dict, str | None]:
    """The budget options with the host cache taken out of the host budget, and the plan note that says so.

    With host_memory_gb it comes out of that (the plan's host tier is that much smaller, so more lies on disk). On
    a CPU-only machine planned with device_memory_gb alone (RAM is the device), it lives in reserve_gb, as the
    device cache does (`beside`: that cache's bytes, which share the reserve; `process`: the process's own, measured,
    which lives there too): the weights' room is unchanged. A
    plan given ready-made (`planned`) or a budget without either is left as it is, and the note says the cache is
    memory on top of it. BudgetError where the cache does not fit."""
    from ..planning.planner import DEFAULT_RESERVE_GB

    if not capacity:
        return budget, None
    size, gib = format_bytes(capacity), capacity / (1 << 30)
    if not planned and budget.get("host_memory_gb") is not None:
        have = budget["host_memory_gb"]
        if gib > have:
            raise BudgetError(f"--host-cache-gb {gib:g} does not fit in the {have:g} GiB of host memory it is taken "
                              "out of: give a smaller host cache or more --host-memory")
        return {**budget, "host_memory_gb": have - gib}, (
            f"the host cache of disk-tier experts ({size}) is taken out of the {have:g} GiB of host memory: "
            f"{have - gib:.4g} GiB remain for the plan's host tier")
    if not planned and budget.get("cpu_only") and budget.get("device_memory_gb") is not None:
        reserve = budget.get("reserve_gb") if budget.get("reserve_gb") is not None else DEFAULT_RESERVE_GB
        room = math.floor(reserve * (1 << 30)) - beside - process
        if capacity > room:
            also = [w for w, n in (("the device cache", beside), (f"the process itself ({format_bytes(process)}, "
                                                                    "measured)", process)) if n]
            raise BudgetError(f"--host-cache-gb {gib:g} does not fit in the {reserve:g} GiB reserve"
                              f"{' beside ' + ' and '.join(also) if also else ''} ({size} > "
                              f"{format_bytes(max(room, 0))}):"
                              " on a CPU-only machine the host cache lives in the reserve kept beside the weights; "
                              "give a larger --reserve-gb or a smaller host cache")
        return budget, (f"the host cache of disk-tier experts ({size}) is taken out of the {reserve:g} GiB reserve "
                        "(RAM beside the weights)")
    return budget, f"the host cache of disk-tier experts ({size}) is host memory on top of the plan's"


def host_cache_stats(cache: HostCache | None) -> dict:
    """The host cache's counts for reports; without one: no policy, all zeros."""
    if cache is None:
        return {"host_cache_policy": None, "host_cache_bytes": 0, "host_cache_hits": 0, "host_cache_misses": 0,
                "host_cache_evictions": 0, "host_cache_host_bytes": 0}
    return cache.stats()
