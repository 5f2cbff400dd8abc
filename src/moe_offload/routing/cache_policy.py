"""Device-side expert caches: one object per policy, driven alike by the runtime and by `replay`.

A cache holds offloaded routed experts on the device, keyed `(layer, expert)`, within
`capacity_bytes` (exact int bytes, never exceeded). `access(key, nbytes)` is called once per
selected offloaded expert, per layer in ascending expert id, per decode step. It returns True
on a hit (the token reads nothing over the link); on a miss the policy either admits the
expert, evicting residents, or declines it (the expert is read from the host as without a
cache). After each access `last_evicted` names the keys it evicted and `slot(key)` gives a
resident's device slot: the runtime copies an admitted expert into the slot its victim freed.

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

Rules:

- Online policies never evict an expert of the current layer step (a run of accesses in one
  layer with ascending ids: the experts that layer computes with now) to admit another of
  the same step; a cache too small for the whole step declines the rest. Belady, a floor
  rather than a runtime, may: no online policy under the rule can do better than it.
- Time is counted in sweeps, one per decode step. The runtime and replay say where a step starts
  (`begin_step()`, once per decoded token, even one that reads nothing offloaded): accesses alone
  cannot tell two tokens that each reach only one offloaded layer with rising ids from one token.
  A caller that never calls `begin_step` (a plain key sequence) gets steps inferred from the
  order: a new sweep when an access goes back to an earlier (or the same) layer.
- `capacity_bytes == 0` is "no cache" (every access a miss, nothing admitted). An expert
  larger than a non-zero capacity is a BudgetError: such a cache could never hold it, which
  is a misconfiguration rather than something to degrade into silently.
- Slots: the smallest free slot id goes to each admitted expert. When every expert has the
  same bytes, ids stay below `capacity_bytes // nbytes`, so the runtime carves that many
  fixed-size slots once and copies an admitted expert into the slot of the key it evicted
  (`last_evicted`); with mixed sizes ids stay below the most experts resident at once.
- `invalidate(key)` drops a resident copy whose weights changed (the policy's history stays).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from typing import Hashable, Iterable, Sequence

from ..errors import BudgetError, SelectorError

Key = Hashable  # (layer, expert) in the runtime and in replay


class ExpertCache:
    """Byte-exact bookkeeping, layer-step protection and slots; subclasses choose victims."""

    name = "none"
    protects_step = True  # online policies keep a layer step's experts together (see the module docstring)

    def __init__(self, capacity_bytes: int):
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise BudgetError(f"cache capacity {capacity_bytes!r}: give a whole number of bytes >= 0 "
                              "(0 means no cache)")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.declined = 0  # misses the policy chose not to admit (read from the host as without a cache)
        self.last_evicted: tuple = ()
        self._bytes: dict = {}  # resident key -> its bytes
        self._slots: dict = {}  # resident key -> slot id
        self._free_slots: list[int] = []  # heap of freed slot ids
        self._next_slot = 0
        self._step: set = set()  # keys of the current layer step: never victims
        self._step_layer = None
        self._step_last = None
        self.clock = 0  # accesses so far
        self.sweeps = 0  # decode steps so far (begun by begin_step, or inferred from the access order)
        self._marked = False  # the caller marks steps with begin_step()

    # -- the interface the runtime and replay drive ------------------------------------------
    def begin_step(self) -> None:
        """A decode step (one decoded token) starts: the next access opens its first layer step."""
        self._marked = True
        self.sweeps += 1
        self._step = set()
        self._step_layer = None
        self._step_last = None

    def access(self, key: Key, nbytes: int) -> bool:
        layer, expert = key
        if self._marked:
            if layer != self._step_layer:   # the next layer of this decode step
                self._step = set()
                self._step_layer = layer
        elif layer != self._step_layer or expert <= self._step_last:
            if self._step_layer is None or layer <= self._step_layer:
                self.sweeps += 1  # back to an earlier (or the same) layer: the next token or step
            self._step = set()
            self._step_layer = layer
        self._step_last = expert
        self._step.add(key)
        self.clock += 1
        self.last_evicted = ()
        if key in self._bytes:
            self.hits += 1
            self._on_hit(key)
            return True
        self.misses += 1
        self._on_miss(key)
        if nbytes > self.capacity_bytes:
            if self.capacity_bytes == 0:
                self.declined += 1
                return False
            raise BudgetError(f"an expert of {nbytes} bytes ({key}) does not fit in a cache of "
                              f"{self.capacity_bytes} bytes: the cache could never hold it; give a cache of at "
                              f"least {nbytes} bytes ({nbytes / (1 << 30):.4g} GiB), or 0 for no cache")
        need = nbytes - (self.capacity_bytes - self.used_bytes)
        victims = self._victims(key, nbytes, need) if need > 0 else []
        if victims is None:
            self.declined += 1
            return False
        for v in victims:
            self.used_bytes -= self._bytes.pop(v)
            heapq.heappush(self._free_slots, self._slots.pop(v))
            self._on_evict(v)
        self.evictions += len(victims)
        self.last_evicted = tuple(victims)
        if self._free_slots:
            self._slots[key] = heapq.heappop(self._free_slots)
        else:
            self._slots[key] = self._next_slot
            self._next_slot += 1
        self._bytes[key] = nbytes
        self.used_bytes += nbytes
        assert self.used_bytes <= self.capacity_bytes, (self.used_bytes, self.capacity_bytes)
        self._on_admit(key)
        return False

    def slot(self, key: Key) -> int:
        """The device slot of a resident expert (KeyError when it is not resident)."""
        return self._slots[key]

    def contents(self) -> set:
        return set(self._bytes)

    def __contains__(self, key) -> bool:
        return key in self._bytes

    def __len__(self) -> int:
        return len(self._bytes)

    def invalidate(self, key: Key) -> bool:
        """Drop a resident copy whose weights changed (the policy keeps its history); True if it was resident."""
        if key not in self._bytes:
            return False
        self.used_bytes -= self._bytes.pop(key)
        heapq.heappush(self._free_slots, self._slots.pop(key))
        self._on_evict(key)
        return True

    # -- what a policy decides ---------------------------------------------------------------
    def _on_hit(self, key) -> None:
        pass

    def _on_miss(self, key) -> None:
        """A non-resident key was accessed (before the admission decision)."""

    def _on_admit(self, key) -> None:
        pass

    def _on_evict(self, key) -> None:
        pass

    def _victims(self, key, nbytes: int, need: int) -> list | None:
        """Residents (not of this layer step) to evict, freeing >= need bytes, in order; None declines `key`."""
        raise NotImplementedError

    def _heap_victims(self, heap: list, current, need: int) -> tuple[list, list] | None:
        """Pop valid, evictable entries of a lazy min-heap until `need` bytes are covered.

        `current(key)` is the entry a resident key would have now; popped stale entries are
        dropped. Returns (victims, their entries) or None (state restored) when impossible.
        """
        victims, entries, held, freed = [], [], [], 0
        while freed < need and heap:
            entry = heapq.heappop(heap)
            k = entry[-1]
            if k not in self._bytes or current(k) != entry:
                continue  # stale: the key was touched again or left the cache
            if self.protects_step and k in self._step:
                held.append(entry)
                continue
            victims.append(k)
            entries.append(entry)
            freed += self._bytes[k]
        for entry in held:
            heapq.heappush(heap, entry)
        if freed < need:
            for entry in entries:
                heapq.heappush(heap, entry)
            return None
        return victims, entries

    def _compact(self, heap: list, current) -> list:
        """Rebuild a lazy heap from the residents once stale entries dominate (bounded memory)."""
        if len(heap) <= 4 * len(self._bytes) + 1024:
            return heap
        fresh = [current(k) for k in self._bytes]
        heapq.heapify(fresh)
        return fresh


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


HEAT_HALF_LIFE = 24.0  # sweeps (decode steps); chosen on training-domain routing, see the README


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
