"""One arena of equal pages for cached experts: the bookkeeping the device cache and the host cache share
(`PagedArena`), and what each cache is over it (`PagedCache`: its policy and its pages, emptied alike).

The arena is uint8 [pages, page_bytes], page_bytes the greatest common divisor of every cached tensor row (one
expert's slice of one tensor), carved once: whatever set of experts a policy holds within its capacity fits in
capacity // page_bytes pages, wherever the free pages are, with no fragmentation whatever the mix of row sizes.
An admitted expert claims, per tensor of its layer, that row's pages; an evicted one gives them back. A row is
given one run of consecutive page ids wherever the free pages hold one (the shortest run that fits, lowest first,
so longer runs stay whole for longer rows), and scattered pages only where none is long enough: a row in one run
is read in place (host_cache.run_start) and copied in one memcpy, a scattered one is copied out run by run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Iterable

import torch

from ..routing.cache_policy import make_cache
from ..routing.expert_cache import ExpertCache
from ..storage.host import expert_runs
from ..storage.huge_pages import advise_huge


class PagedArena:
    """Pages of one arena, and which key holds which (per tensor of its layer, its page ids)."""

    def __init__(self):
        self.page_bytes = 0
        self.arena: torch.Tensor | None = None
        self.free: list[int] = []                                 # free page ids, ascending
        self.held: dict[Hashable, tuple[list[int], ...]] = {}     # key -> per tensor, its pages

    def carve(self, row_bytes: Iterable[int], expert_bytes: Iterable[int], capacity: int,
              device: torch.device | str = "cpu") -> None:
        """Pages for rows of these sizes within `capacity` bytes, never more than every expert (of
        `expert_bytes`) together; the tensor is kept when its shape and device do not change. Nothing is held."""
        rows = list(row_bytes)
        self.held = {}
        if not rows:   # nothing to cache: nothing carved
            self.page_bytes, self.arena, self.free = 0, None, []
            return
        page = math.gcd(*rows)
        pages = min(capacity // page, sum(n // page for n in expert_bytes))
        if self.arena is None or tuple(self.arena.shape) != (pages, page) or self.arena.device != torch.device(device):
            # zeros, not empty: every page is touched now, at load, so no admission on the decode path pays the
            # first-touch faults of its pages (measured: a 6 MiB store into fresh pages took 6-30 ms on a cpu)
            # (in 2 MiB pages where the kernel allows: asked before the zeros are written, storage/huge_pages.py)
            self.arena = torch.empty((pages, page), dtype=torch.uint8, device=device)
            advise_huge(self.arena)
            self.arena.zero_()
        self.page_bytes = page
        self.free = list(range(pages))

    @property
    def nbytes(self) -> int:
        return 0 if self.arena is None else self.arena.numel()

    def claim(self, key: Hashable, row_bytes: Iterable[int]) -> tuple[list[int], ...]:
        """Pages for `key`'s rows (0 bytes: a tensor the expert has no row in)."""
        pages = []
        for b in row_bytes:
            n = b // self.page_bytes if b else 0
            assert n <= len(self.free), "the policy admitted more bytes than the arena holds"
            pages.append(self._take(n))
        self.held[key] = tuple(pages)
        return self.held[key]

    def _take(self, n: int) -> list[int]:
        """n free pages: the shortest run of at least n consecutive free ids (the lowest of equals), its first n;
        the lowest n free pages where no run is that long (the arena fits any mix, in runs or not)."""
        fits = [(count, at) for at, _, count in expert_runs(self.free) if count >= n]
        at = min(fits)[1] if fits and n else 0
        taken = self.free[at:at + n]
        del self.free[at:at + n]
        return taken

    def release(self, key: Hashable) -> None:
        for pages in self.held.pop(key):
            self.free.extend(pages)
        self.free.sort()   # ascending again (a merge of sorted runs)


@dataclass(frozen=True)
class Decision:
    """What a cache's policy did with each selected expert of one layer step (ascending ids), in replay's order."""

    layer: int
    names: tuple[str, ...]        # the layer's cached tensors (local names): the order of each expert's page lists
    hit: dict[int, bool]          # expert -> the cache holds it (read from its pages); absent: nothing of it cached
    pages: dict[int, tuple]       # expert -> per tensor, its pages (hits: to read; admitted misses: to fill)

    def held(self, expert: int) -> bool:
        return self.hit.get(expert, False)

    def admitted(self, expert: int) -> bool:
        """A miss the policy admitted: its rows go into the pages it claimed once they are read."""
        return not self.hit.get(expert, False) and expert in self.pages

    def pages_of(self, expert: int, name: str) -> list[int]:
        return self.pages[expert][self.names.index(name)]


class PagedCache:
    """A cache of routed experts in pages carved once, under one cache policy: what the device cache and the host
    cache have in common (each lays out its own layers, `_layers`, and reads and writes its own pages)."""

    def __init__(self, policy: str, capacity_bytes: int):
        self.policy_name = policy
        self.capacity_bytes = capacity_bytes
        self.policy: ExpertCache = make_cache(policy, capacity_bytes)
        self.pages = PagedArena()                 # uint8 [pages, page_bytes] in the cache's memory
        self._layers: dict = {}

    @property
    def page_bytes(self) -> int:
        return self.pages.page_bytes

    @property
    def arena(self) -> torch.Tensor | None:
        return self.pages.arena

    def serves(self, layer: int | None) -> bool:
        return layer in self._layers

    def drop_all(self) -> None:
        """Forget every cached copy (the policy keeps its history, as after an invalidation)."""
        for key in list(self.pages.held):
            self.policy.invalidate(key)
            self.pages.release(key)

    def reset(self) -> None:
        """Empty, with a fresh policy (no history, counts at 0): as just after load."""
        self.drop_all()
        self.policy = make_cache(self.policy_name, self.capacity_bytes)

    def contents(self) -> set:
        return set(self.pages.held)

    def decide(self, layer: int, ids: list[int]) -> Decision:
        """The policy's decisions for the selected experts `ids` (ascending) of `layer`, in replay's order: each with
        cached bytes is accessed, the victims' pages freed, an admitted one's pages claimed at once. Each cache's
        layer layout (`_layers`) gives `names`, `nbytes` per expert and `row_bytes_of(expert)` per tensor."""
        lay = self._layers[layer]
        hit, pages = {}, {}
        for e in ids:
            nbytes = lay.nbytes[e]
            if not nbytes:
                continue
            key = (layer, e)
            hit[e] = self.policy.access(key, nbytes)
            for victim in self.policy.last_evicted:   # never of this layer step: the policy protects its experts
                self.pages.release(victim)
            if not hit[e] and key in self.policy:       # admitted: claim its pages now
                self.pages.claim(key, lay.row_bytes_of(e))
            if key in self.pages.held:
                pages[e] = self.pages.held[key]
        return Decision(layer, lay.names, hit, pages)
