"""Device-side expert cache policies: one object per policy, driven alike by the runtime and by `replay`.

Each policy is an `ExpertCache` (expert_cache.py: the `access` interface, byte-exact bookkeeping,
layer-step protection and slots, and the rules every policy keeps); it chooses only which residents
to evict and whether to admit a newcomer.

Policies (`make_cache(name, capacity_bytes)`):

- `heat` (the default, this project's own): every expert seen has a *heat*, its use count
  with each use fading by half every 24 sweeps (decode steps). Evict the coldest resident;
  admit a newcomer only when it is hotter than every expert it would evict, otherwise read
  it from the host and keep the cache as it is. The fading follows what one request needs
  now (its topic, its language) where LFU's lifetime counts cannot; the admission test keeps
  a rarely used expert from flushing a hot one, which LRU cannot refuse (a cache smaller
  than one token's picks makes LRU evict every expert just before it is needed again).
  Heat is kept for evicted experts too, so a returning expert competes with its history.
  Heat is a per-token rate, comparable across layers: the one cache the layers share holds
  the hottest experts of the whole model, not a fixed share per layer.
- `lru`: evict the least recently used expert; always admit.
- `lfu`: evict the expert with the fewest accesses since the cache was made (counts survive
  eviction, "perfect" LFU); ties go to the least recently used; always admit.
- `belady`: the offline optimum, for `replay` only (it needs `future`, the whole key sequence):
  evict the expert whose next use is farthest ahead (never again first), and decline an
  expert whose own next use is farther still (bypass). Optimal in misses when every expert
  has the same bytes (tests/test_cache_policy.py checks it against brute force); with mixed
  sizes it is the farthest-first heuristic.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import OrderedDict
from typing import Iterable, Sequence

from ..errors import SelectorError
from .expert_cache import ExpertCache, Key


class LRUCache(ExpertCache):
    """Evict the least recently used expert."""

    name = "lru"

    def __init__(self, capacity_bytes: int):
        super().__init__(capacity_bytes)
        self._order: OrderedDict = OrderedDict()  # oldest first

    def _on_hit(self, key):
        self._order.move_to_end(key)

    def _on_admit(self, key):
        self._order[key] = None

    def _on_evict(self, key):
        del self._order[key]

    def _victims(self, key, nbytes, need):
        victims, freed = [], 0
        for k in self._order:
            if freed >= need:
                break
            if k not in self._step:
                victims.append(k)
                freed += self._bytes[k]
        return victims if freed >= need else None


class _ScoredCache(ExpertCache):
    """A policy that evicts the lowest score first: every access updates the score (`_touch`), and a lazy
    min-heap of (score..., key) entries (`_entry`) finds the victims; stale entries are skipped."""

    _heap: list

    def _entry(self, key):
        raise NotImplementedError

    def _touch(self, key) -> None:
        raise NotImplementedError

    def _on_hit(self, key):
        self._touch(key)
        heapq.heappush(self._heap, self._entry(key))
        self._heap = self._compact(self._heap, self._entry)

    def _on_miss(self, key):
        self._touch(key)

    def _on_admit(self, key):
        heapq.heappush(self._heap, self._entry(key))

    def _on_preload(self, key):   # the prefill's read counts as one use
        self._touch(key)
        self._on_admit(key)


class LFUCache(_ScoredCache):
    """Evict the expert with the fewest accesses so far (counts survive eviction); ties: least recently used."""

    name = "lfu"

    def __init__(self, capacity_bytes: int):
        super().__init__(capacity_bytes)
        self._count: dict = {}
        self._last: dict = {}
        self._heap: list = []  # (count, last access, key), lazily stale

    def _entry(self, key):
        return (self._count[key], self._last[key], key)

    def _touch(self, key):
        self._count[key] = self._count.get(key, 0) + 1
        self._last[key] = self.clock

    def _victims(self, key, nbytes, need):
        found = self._heap_victims(self._heap, self._entry, need)
        return None if found is None else found[0]


class BeladyCache(ExpertCache):
    """Offline optimum: evict the expert used again farthest ahead; bypass one used later still."""

    name = "belady"
    # The floor is a relaxation: it may evict an expert of the current layer step, so no online policy
    # under the rules can beat it (with the rule, farthest-first would no longer be optimal).
    protects_step = False

    def __init__(self, capacity_bytes: int, future: Sequence[Key]):
        super().__init__(capacity_bytes)
        self._future = future
        never = len(future)  # "never again" sorts after every real position
        self._next_use = [never] * len(future)
        seen: dict = {}
        for i in range(len(future) - 1, -1, -1):
            k = future[i]
            self._next_use[i] = seen.get(k, never)
            seen[k] = i
        self._next: dict = {}  # resident key -> its next use
        self._heap: list = []  # (-next use, key): the farthest first
        self._incoming = never  # the next use of the key being accessed
        self._uses: dict | None = None   # key -> its positions in `future` (preload's lookup), made when needed

    def _advance(self, key):
        pos = self.clock - 1
        if pos >= len(self._future) or self._future[pos] != key:
            expected = self._future[pos] if pos < len(self._future) else "the end of the sequence"
            raise ValueError(f"belady: access #{pos} is {key}, but its future says {expected}")
        return self._next_use[pos]

    def _entry(self, key):
        return (-self._next[key], key)

    def _on_hit(self, key):
        self._next[key] = self._advance(key)
        heapq.heappush(self._heap, self._entry(key))
        self._heap = self._compact(self._heap, self._entry)

    def _on_miss(self, key):
        self._incoming = self._advance(key)

    def _on_admit(self, key):
        self._next[key] = self._incoming
        heapq.heappush(self._heap, self._entry(key))

    def _on_evict(self, key):
        del self._next[key]

    def _on_preload(self, key):   # its next use: the first access of it from now on
        if self._uses is None:    # key -> its positions in the future, ascending (made at the first preload)
            self._uses = {}
            for i, k in enumerate(self._future):
                self._uses.setdefault(k, []).append(i)
        uses = self._uses.get(key, [])
        at = bisect.bisect_left(uses, self.clock)
        self._incoming = uses[at] if at < len(uses) else len(self._future)
        self._on_admit(key)

    def _victims(self, key, nbytes, need):
        found = self._heap_victims(self._heap, self._entry, need)
        if found is None:
            return None
        victims, entries = found
        # Keeping every victim is at least as good when the newcomer is needed no sooner than any of them.
        if self._incoming >= min(-e[0] for e in entries):
            for e in entries:
                heapq.heappush(self._heap, e)
            return None
        return victims


HEAT_HALF_LIFE = 24.0  # sweeps (decode steps); chosen on training-domain routing, see docs/results.md (expert caches)


class HeatCache(_ScoredCache):
    """Evict the coldest expert; admit a newcomer only when it is hotter than every expert it would evict.

    An expert's heat is its use count with each use decaying by half every `half_life` sweeps:
    heat(t) = sum over its uses i of 2^(-(t - t_i) / half_life). Heat is kept for every expert
    ever seen, so one evicted comes back with its history. Stored as log2 heat + t / half_life
    (forward decay), which orders experts the same at every later time: a lazy heap works.
    """

    name = "heat"

    def __init__(self, capacity_bytes: int, *, half_life: float = HEAT_HALF_LIFE):
        super().__init__(capacity_bytes)
        if not half_life > 0:
            raise ValueError(f"half_life {half_life!r}: give a positive number of sweeps")
        self.half_life = float(half_life)
        self._heat: dict = {}  # key -> log2 heat referred to sweep 0
        self._heap: list = []  # (heat, key), lazily stale

    def _entry(self, key):
        return (self._heat[key], key)

    def _touch(self, key):
        x = self.sweeps / self.half_life
        h = self._heat.get(key)
        if h is None:
            self._heat[key] = x
        elif h - x > 50:  # adding a negligible 2^x
            pass
        else:
            hi, lo = (h, x) if h > x else (x, h)
            self._heat[key] = hi + math.log2(1.0 + 2.0 ** (lo - hi))

    def _victims(self, key, nbytes, need):
        found = self._heap_victims(self._heap, self._entry, need)
        if found is None:
            return None
        victims, entries = found
        if self._heat[key] <= entries[-1][0]:  # the hottest victim is at least as hot: keep them all
            for e in entries:
                heapq.heappush(self._heap, e)
            return None
        return victims


POLICIES = {"lru": LRUCache, "lfu": LFUCache, "heat": HeatCache}
OFFLINE_POLICIES = {"belady": BeladyCache}
DEFAULT_CACHE_POLICY = "heat"


def cache_policy_names(*, offline: bool = False) -> tuple[str, ...]:
    return tuple(POLICIES) + (tuple(OFFLINE_POLICIES) if offline else ())


def make_cache(policy: str, capacity_bytes: int, *, future: Iterable[Key] | None = None) -> ExpertCache:
    """A fresh cache of `capacity_bytes` under `policy`; `future` (the whole key sequence) for `belady` only."""
    if policy in OFFLINE_POLICIES:
        if future is None:
            raise SelectorError(f"cache policy {policy!r} is the offline optimum: it needs the whole access "
                                "sequence, which only `replay` has; use one of "
                                f"{', '.join(cache_policy_names())} to run a model")
        return OFFLINE_POLICIES[policy](capacity_bytes, list(future))
    if policy not in POLICIES:
        raise SelectorError(f"unknown cache policy {policy!r}: choose one of "
                            f"{', '.join(cache_policy_names(offline=True))} (belady in replay only)")
    if future is not None:
        raise SelectorError(f"cache policy {policy!r} is online and takes no future; only belady does")
    return POLICIES[policy](capacity_bytes)
