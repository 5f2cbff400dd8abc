"""The expert cache's bookkeeping, shared by every policy (cache_policy.py): bytes, layer steps, slots.

A cache holds offloaded routed experts on the device, keyed `(layer, expert)`, within
`capacity_bytes` (exact int bytes, never exceeded). `access(key, nbytes)` is called once per
selected offloaded expert, per layer in ascending expert id, per decode step. It returns True
on a hit (the token reads nothing over the link); on a miss the policy either admits the
expert, evicting residents, or declines it (the expert is read from the host as without a
cache). After each access `last_evicted` names the keys it evicted and `slot(key)` gives a
resident's device slot: the runtime copies an admitted expert into the slot its victim freed.

`ExpertCache` does the byte-exact accounting, the layer-step protection, the sweeps and the slots;
a policy (cache_policy.py) chooses the victims and whether to admit.

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
- `preload(key, nbytes)`: what a prefill leaves behind. A prefill is no access (no hit, miss, clock or sweep),
  but the experts it read may stay in room the cache has free: admitted without evicting anything (the policy
  notes them as it notes an admission, with one use where it counts uses). Which ones: `prefill_keeps`, one
  rule for the runtime's host cache and replay.
"""

from __future__ import annotations

import heapq
from typing import Hashable, Sequence

from ..errors import BudgetError

Key = Hashable  # (layer, expert) in the runtime and in replay


def prefill_keeps(picks: Sequence[int], nbytes: Sequence[int], room: int) -> list[int]:
    """The experts of one layer a prefill leaves in a cache (ascending ids): those it read (`picks[e]` > 0 of its
    tokens picked e, `nbytes[e]` > 0 bytes cached), the most picked first (ties: the lower id), each while its bytes
    still fit in `room`. The most picked experts of a prompt are the likeliest of its first decoded tokens' (measured
    at Qwen3-30B-A3B's dimensions: a prompt's 23 most picked per layer held 61-63 of the first token's 64)."""
    kept, used = [], 0
    for e in sorted((e for e, n in enumerate(picks) if n > 0 and nbytes[e] > 0), key=lambda e: (-picks[e], e)):
        if used + nbytes[e] <= room:
            kept.append(e)
            used += nbytes[e]
    return sorted(kept)


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
        self._hold(key, nbytes)
        assert self.used_bytes <= self.capacity_bytes, (self.used_bytes, self.capacity_bytes)
        self._on_admit(key)
        return False

    def preload(self, key: Key, nbytes: int) -> bool:
        """Admit `key` into free room, evicting nothing, as no access (what a prefill leaves; module docstring):
        True when admitted, False when resident already or `nbytes` exceed the free room."""
        self.last_evicted = ()
        if key in self._bytes or nbytes > self.capacity_bytes - self.used_bytes:
            return False
        self._hold(key, nbytes)
        self._on_preload(key)
        return True

    def prefill_room(self, layers: int) -> int:
        """The bytes a prefill may leave in this cache for one of `layers` layers: that layer's share of the
        capacity, at most the room still free (what prefill_keeps is given, by the runtime and by replay)."""
        return min(self.capacity_bytes // layers, self.capacity_bytes - self.used_bytes)

    def _hold(self, key: Key, nbytes: int) -> None:
        """key resident: the smallest free slot, its bytes counted."""
        if self._free_slots:
            self._slots[key] = heapq.heappop(self._free_slots)
        else:
            self._slots[key] = self._next_slot
            self._next_slot += 1
        self._bytes[key] = nbytes
        self.used_bytes += nbytes

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

    def _on_preload(self, key) -> None:
        """A prefill left `key` in free room (preload): noted as an admission."""
        self._on_admit(key)

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
