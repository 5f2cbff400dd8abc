"""Replay: the bytes the decode tokens of a trace would read under a placement and a cache.

Nothing runs: a plan gives the offloaded bytes of every expert of every layer (accounting.py),
a trace gives which experts each token picked. At batch 1 each decode token reads, over the
link, every offloaded dense tensor in full, one row of each offloaded lookup table, and the
offloaded bytes of every offloaded expert it picked that the cache does not hold.

Without a cache the count is a few array gathers per layer (10^5 tokens x 60 layers in well
under a second). With a cache, accesses are sequential by nature: per token, per layer in
order, per picked offloaded expert in ascending id, `cache.access((layer, expert), nbytes)`,
the interface the runtime drives too (cache_policy.py), with the access sequence built by
numpy so that the Python work per access is the call alone. Before a prompt's first decode token, the host cache
takes what that prompt's prefill left in it (the trace's prefill rows: leave_prefill), as the runtime's does.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
import numpy as np

from ..planning.accounting import TokenBytes
from ..errors import MoeOffloadError, TraceError
from ..planning.placement import GiB, Plan
from ..formats.traces import Phase, Trace, TraceRow, check_trace_matches, routing_array
from .expert_cache import prefill_keeps


@dataclass(frozen=True)
class ReplayResult:
    tokens: int                        # decode tokens replayed
    link_bytes_per_token: float        # host + disk
    host_link_bytes_per_token: float
    disk_read_bytes_per_token: float
    expert_reads: int                  # offloaded expert fetches that crossed the link (cache misses)
    cache_hits: int
    cache_misses: int                  # = expert_reads: without a cache every offloaded pick is a miss
    policy: str
    cache_policy: str | None
    offloaded_bytes: int
    cache_bytes: int
    # the host-memory cache of disk-tier experts (--host-cache-gb): its policy (None: none), size and counts
    host_cache_policy: str | None = None
    host_cache_bytes: int = 0
    host_cache_hits: int = 0
    host_cache_misses: int = 0
    # from the trace's `predicted` lists (None without them): look-ahead of offloaded experts, as run/lookahead.py;
    # wasted = every unpicked guess's bytes read in full (the runtime's wasted + cancelled bytes: it stops some)
    lookahead_hits: int | None = None
    lookahead_misses: int | None = None
    lookahead_wasted_bytes_per_token: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class RoutingCost:
    """Totals over the replayed tokens."""

    tokens: int
    host_bytes: int
    disk_bytes: int
    expert_reads: int
    cache_hits: int
    lookahead: tuple[int, int, int] | None = None   # (hits, misses, wasted bytes) with predictions


def lookahead_counts(tb: TokenBytes, predicted: np.ndarray, needed, device_held, host_held) -> tuple[int, int, int]:
    """Look-ahead figures. `needed(token, layer row)`: the picked experts that layer step read from below the
    device (the device cache missed them; host-tier bytes over the link, disk-tier bytes from disk unless the host
    cache hit). A guess is read ahead when the device cache did not hold it as its layer began
    (`device_held(token, layer row)`: the keys it held then), its disk-tier bytes unless the host cache held it
    (`host_held`, alike). A needed expert is a hit when it was guessed, else a miss; a guess not picked is read in
    vain (its bytes wasted)."""
    hits = misses = wasted = 0
    t, n_layers, _ = predicted.shape
    for i in range(t):
        for row in range(n_layers):
            host, disk, layer = tb.expert_host[row], tb.expert_disk[row], tb.layers[row]
            dev, held = device_held(i, row), host_held(i, row)

            def ahead(e: int) -> int:   # the bytes a guess of e reads ahead
                if (layer, e) in dev:
                    return 0
                return int(host[e]) + (0 if (layer, e) in held else int(disk[e]))

            need = needed(i, row)
            guess = {int(e) for e in predicted[i, row] if e >= 0 and ahead(int(e))}
            hits += len(need & guess)
            misses += len(need - guess)
            wasted += sum(ahead(e) for e in guess - need)
    return hits, misses, wasted


@dataclass(frozen=True, eq=False)
class CacheWalk:
    """Every cache access of a replay, in the runtime's order (token, layer row, ascending expert id; offloaded
    picks only), and what the caches answered: `hit`, held by the device cache (nothing read from below the
    device); `in_host`, its disk bytes held by the host cache; `held`, with `snapshot`, the keys each cache held
    as each (token, layer row) began."""

    tok: np.ndarray
    lay: np.ndarray
    experts: np.ndarray
    hit: np.ndarray
    in_host: np.ndarray
    held: dict
    admitted: np.ndarray | None = None   # with `admissions`: a device-cache miss the cache took in (it travels)


def prefill_picks(trace: Trace, n_layers: int, num_experts: int) -> dict[int, np.ndarray]:
    """Decode token index (in the trace's decode rows) -> [layers, experts] picks of the prefill rows just before it:
    what the runtime's prefill of that prompt left in the host cache is a function of these (leave_prefill)."""
    out, pending, decoded = {}, None, 0
    for r in trace.rows:
        if r.phase == Phase.PREFILL:
            if pending is None:
                pending = np.zeros((n_layers, num_experts), np.int64)
            for row, picks in enumerate(r.experts):
                np.add.at(pending[row], [e for e in picks if 0 <= e < num_experts], 1)
        else:
            if pending is not None:
                out[decoded], pending = pending, None
            decoded += 1
    return out


def leave_prefill(tb: TokenBytes, host_cache, picks: np.ndarray) -> None:
    """What a prefill leaves in the host cache, as run/host_cache.py leaves it: per layer with disk experts, in
    order, the experts prefill_keeps names (the most picked, within the layer's share of the capacity and the free
    room) preloaded in ascending id."""
    served = [row for row in range(len(tb.layers)) if tb.expert_disk[row].any()]
    if not served:
        return
    for row in served:
        nbytes = tb.expert_disk[row].tolist()
        for e in prefill_keeps(picks[row].tolist(), nbytes, host_cache.prefill_room(len(served))):
            host_cache.preload((int(tb.layers[row]), e), nbytes[e])


def walk_caches(tb: TokenBytes, ids: np.ndarray, *, cache=None, host_cache=None, snapshot: bool = False,
                admissions: bool = False, prefills: dict[int, np.ndarray] | None = None) -> CacheWalk:
    """Drive the caches through the accesses of `ids` as the runtime does (replay_routing's walk, for every user
    of per-access hits): one marked step per token, the device cache first, the host cache on its misses that have
    disk bytes. Without caches, the accesses alone (nothing hit). `admissions`: also note which device-cache misses
    the cache admitted (`key in cache` after the miss; a cache without `__contains__` admits none). `prefills`
    (prefill_picks): before those tokens, what their prompt's prefill left in the host cache."""
    t, n_layers, _ = ids.shape
    host = np.concatenate([tb.expert_host, np.zeros((n_layers, 1), np.int64)], axis=1)
    disk = np.concatenate([tb.expert_disk, np.zeros((n_layers, 1), np.int64)], axis=1)
    tok, lay, experts = _access_order(tb, ids)
    # The device cache holds offloaded experts of both tiers (their host + disk bytes); the host cache below it
    # sees the device cache's misses that have disk bytes (their disk bytes), as the runtime's caches do.
    nbytes = (host + disk)[lay, experts].tolist()
    dbytes = disk[lay, experts].tolist()
    keys = list(zip(np.asarray(tb.layers, dtype=np.int64)[lay].tolist(), experts.tolist()))
    ends = np.searchsorted(tok, np.arange(1, t + 1)).tolist()   # accesses of token i: [ends[i-1], ends[i])
    hit = np.zeros(len(keys), dtype=bool)       # held by the device cache: nothing read
    in_host = np.zeros(len(keys), dtype=bool)   # its disk bytes held by the host cache: read from host memory
    # (token, layer row) -> the device cache's and the host cache's keys when that layer began (for the look-ahead)
    held: dict[tuple[int, int], tuple[set, set]] = {}

    admitted = np.zeros(len(keys), dtype=bool) if admissions else None
    holds = getattr(cache, "__contains__", None) if admissions else None
    if cache is None and host_cache is None:
        return CacheWalk(tok, lay, experts, hit, in_host, held, admitted)
    noted = [-1]                                # the last layer row of this token noted in `held`

    def note_held(i: int, upto: int) -> None:   # layer rows up to `upto` not noted yet begin with these contents
        if upto > noted[0]:                     # one copy per layer reached, not per access
            now = (cache.contents() if cache is not None else set(),
                   host_cache.contents() if host_cache is not None else set())
            for row in range(noted[0] + 1, upto + 1):
                held[(i, row)] = now
            noted[0] = upto

    start = 0
    for i, end in enumerate(ends):   # every token is one decode step, as the runtime marks it
        noted[0] = -1
        if host_cache is not None and prefills and i in prefills:
            leave_prefill(tb, host_cache, prefills[i])
        if cache is not None:
            cache.begin_step()
        if host_cache is not None:
            host_cache.begin_step()
        for j in range(start, end):
            if snapshot:
                note_held(i, int(lay[j]))
            if cache is not None:
                hit[j] = cache.access(keys[j], nbytes[j])
                if holds is not None and not hit[j]:
                    admitted[j] = holds(keys[j])
            if host_cache is not None and not hit[j] and dbytes[j]:
                in_host[j] = host_cache.access(keys[j], dbytes[j])
        if snapshot:
            note_held(i, n_layers - 1)
        start = end
    return CacheWalk(tok, lay, experts, hit, in_host, held, admitted)


def replay_routing(tb: TokenBytes, ids: np.ndarray, *, cache=None, host_cache=None,
                   predicted: np.ndarray | None = None, prefills: dict[int, np.ndarray] | None = None) -> RoutingCost:
    """Bytes read by the tokens of `ids` ([T, layers, width] expert ids in `tb.layers` order, -1 = none).

    cache: an object with access(key, nbytes) -> hit (cache_policy.make_cache), or None.
    host_cache: the same for the host-memory cache of disk-tier experts (run/host_cache.py): an expert with disk
    bytes that the device cache did not hold is looked up there (its disk bytes); a hit reads them from host
    memory (host bytes) instead of the disk.
    predicted: [T, layers, width] ids a look-ahead predictor named (-1 = none): its hits, misses and wasted bytes.
    prefills: walk_caches's (what each prompt's prefill left in the host cache).
    """
    t, n_layers, _ = ids.shape
    if n_layers != len(tb.layers):
        raise ValueError(f"routing of {n_layers} layers for a placement of {len(tb.layers)} routed layers")
    # A zero column appended at the end: id -1 (padding) indexes it and reads nothing.
    host = np.concatenate([tb.expert_host, np.zeros((n_layers, 1), np.int64)], axis=1)
    disk = np.concatenate([tb.expert_disk, np.zeros((n_layers, 1), np.int64)], axis=1)
    host_bytes, disk_bytes = t * tb.dense_host, t * tb.dense_disk
    if cache is None and host_cache is None and predicted is None:
        reads = 0
        for i in range(n_layers):
            h, d = host[i][ids[:, i, :]], disk[i][ids[:, i, :]]   # [T, width] bytes of each pick
            host_bytes += int(h.sum())
            disk_bytes += int(d.sum())
            reads += int(np.count_nonzero(h + d))
        return RoutingCost(t, host_bytes, disk_bytes, reads, 0)

    walk = walk_caches(tb, ids, cache=cache, host_cache=host_cache, prefills=prefills,
                       snapshot=(cache is not None or host_cache is not None) and predicted is not None)
    tok, lay, experts, hit, in_host, held = walk.tok, walk.lay, walk.experts, walk.hit, walk.in_host, walk.held
    miss = ~hit
    moved = int(disk[lay[in_host], experts[in_host]].sum())   # disk bytes the host cache served
    host_bytes += int(host[lay[miss], experts[miss]].sum()) + moved
    disk_bytes += int(disk[lay[miss], experts[miss]].sum()) - moved
    # fetches over the link or from disk (a host-cache hit still crosses the host link to the device)
    reads = int(miss.sum())
    ahead = None
    if predicted is not None:
        needed: dict[tuple[int, int], set] = {}   # (token, layer row) -> experts read from below the device
        below = ~hit & ((host[lay, experts] > 0) | ((disk[lay, experts] > 0) & ~in_host))
        for j in np.nonzero(below)[0].tolist():
            needed.setdefault((int(tok[j]), int(lay[j])), set()).add(int(experts[j]))
        none = (set(), set())
        ahead = lookahead_counts(tb, predicted, lambda i, row: needed.get((i, row), set()),
                                 lambda i, row: held.get((i, row), none)[0], lambda i, row: held.get((i, row), none)[1])
    return RoutingCost(t, host_bytes, disk_bytes, reads, int(hit.sum()), ahead)


def _access_order(tb: TokenBytes, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(token, layer row, expert id) of every cache access, in the runtime's order: token, then layer, then
    ascending expert id; only offloaded experts are accessed (resident ones are on the device already)."""
    n_layers = len(tb.layers)
    off = np.concatenate([tb.expert_host + tb.expert_disk, np.zeros((n_layers, 1), np.int64)], axis=1)
    picks = np.sort(ids, axis=2)                                   # the -1 padding sorts first
    tok, lay, slot = np.nonzero(off[np.arange(n_layers)[None, :, None], picks] > 0)   # C order = access order
    return tok, lay, picks[tok, lay, slot].astype(np.int64)


def access_keys(tb: TokenBytes, ids: np.ndarray, *, disk_only: bool = False) -> list[tuple[int, int]]:
    """The (layer, expert) keys a cache sees for `ids`, in access order (the future an offline policy needs); with
    `disk_only`, those of experts with disk bytes (the host cache's accesses with no device cache above it)."""
    _, lay, experts = _access_order(tb, ids)
    if disk_only:
        keep = tb.expert_disk[lay, experts] > 0
        lay, experts = lay[keep], experts[keep]
    return list(zip(np.asarray(tb.layers, dtype=np.int64)[lay].tolist(), experts.tolist()))


def make_replay_cache(policy: str | None, capacity_bytes: int, future_keys):
    """A cache from cache_policy.py; `future_keys()` is called only for an offline policy (belady)."""
    from . import cache_policy

    name = policy or cache_policy.DEFAULT_CACHE_POLICY
    offline = name in cache_policy.OFFLINE_POLICIES
    return name, cache_policy.make_cache(name, capacity_bytes, future=future_keys() if offline else None)


@dataclass(frozen=True, eq=False)
class ReplayInputs:
    """What a replay of a trace under a plan drives: the plan's token bytes, the decode routing ([T, layers,
    width] ids, -1 = none), fresh caches (None: none) with their policy names and capacities, and the look-ahead's
    predictions (None without them in the trace)."""

    tb: TokenBytes
    ids: np.ndarray
    cache: object
    cache_policy: str | None
    cache_bytes: int
    host_cache: object
    host_cache_policy: str | None
    host_cache_bytes: int
    predicted: np.ndarray | None
    prefills: dict   # decode token index -> its prompt's prefill picks (prefill_picks)


def replay_inputs(plan: Plan, trace: Trace, *, cache_gb: float | None = None, cache_policy: str | None = None,
                  host_cache_gb: float | None = None) -> ReplayInputs:
    """The trace checked against the plan, its decode routing as an array, and fresh caches of the sizes asked
    (each call makes new ones: a cache is used up by one walk)."""
    tb = plan.token_bytes()
    check_trace_matches(trace, num_experts=tb.num_experts or None, layers=tb.layers,
                        where=f"the {plan.model_type} plan")
    rows = trace.decode_rows
    if not rows:
        raise TraceError(f"{trace.name} holds no decode tokens ({len(trace.rows)} prefill rows): replay counts "
                         "decode tokens; profile with --max-new-tokens of at least 1 (and --ignore-eos, so that EOS does not end "
                         "every prompt at once)")
    width = max(1, max(len(ids) for r in rows for ids in r.experts))
    dtype = np.int16 if tb.num_experts < 2 ** 15 else np.int32
    ids = routing_array(rows, width, len(tb.layers), dtype=dtype)
    if cache_policy is not None and cache_gb is None and host_cache_gb is None:
        raise MoeOffloadError(f"--cache-policy {cache_policy} without --cache-gb: give the cache size too")
    cache, name, capacity = None, None, 0
    for flag, gb in (("--cache-gb", cache_gb), ("--host-cache-gb", host_cache_gb)):
        if gb is not None and (not np.isfinite(gb) or gb < 0):
            raise MoeOffloadError(f"{flag} {gb} is not a size: give a non-negative number of GiB")
    if cache_gb is not None:
        capacity = int(cache_gb * GiB)
        name, cache = make_replay_cache(cache_policy, capacity, lambda: access_keys(tb, ids))
    host_cache, host_name, host_capacity = None, None, 0
    if host_cache_gb is not None:
        if cache is not None and name == "belady":
            raise MoeOffloadError("belady at two cache levels is not modelled: give --cache-gb or --host-cache-gb "
                                  "alone with belady, or an online policy for both")
        host_capacity = int(host_cache_gb * GiB)
        host_name, host_cache = make_replay_cache(cache_policy, host_capacity,
                                                  lambda: access_keys(tb, ids, disk_only=True))
    predicted = None
    if all(r.predicted is not None for r in rows):
        pwidth = max(1, max(len(p) for r in rows for p in r.predicted))
        predicted = routing_array([TraceRow(r.seq, r.pos, r.phase, r.predicted) for r in rows], pwidth,
                                  len(tb.layers), dtype=dtype)
    return ReplayInputs(tb, ids, cache, name, capacity, host_cache, host_name, host_capacity, predicted,
                        prefill_picks(trace, len(tb.layers), tb.num_experts))


def replay(plan: Plan, trace: Trace, *, cache_gb: float | None = None, cache_policy: str | None = None,
           policy: str | None = None, host_cache_gb: float | None = None) -> ReplayResult:
    """Replay the decode tokens of `trace` (batch 1) under `plan` and an optional cache of `cache_gb` GiB.

    host_cache_gb: a host-memory cache of disk-tier experts (the same policy), below the device cache. The plan
    is taken as given: a runtime loaded with host_cache_gb planned with the cache carved out of its host memory
    (run/host_cache.carve), so replay that plan (`replay --host-cache-gb` does).

    policy: the label reported (default: the plan's; replay's `oracle` is a frequency plan).
    """
    inputs = replay_inputs(plan, trace, cache_gb=cache_gb, cache_policy=cache_policy, host_cache_gb=host_cache_gb)
    host_cache = inputs.host_cache
    cost = replay_routing(inputs.tb, inputs.ids, cache=inputs.cache, host_cache=host_cache,
                          predicted=inputs.predicted, prefills=inputs.prefills)
    n = cost.tokens
    return ReplayResult(
        tokens=n, link_bytes_per_token=(cost.host_bytes + cost.disk_bytes) / n,
        host_link_bytes_per_token=cost.host_bytes / n, disk_read_bytes_per_token=cost.disk_bytes / n,
        expert_reads=cost.expert_reads, cache_hits=cost.cache_hits,
        cache_misses=cost.expert_reads,
        policy=policy or plan.policy, cache_policy=inputs.cache_policy, offloaded_bytes=plan.offloaded_bytes,
        cache_bytes=inputs.cache_bytes,
        host_cache_policy=inputs.host_cache_policy, host_cache_bytes=inputs.host_cache_bytes,
        host_cache_hits=host_cache.hits if host_cache is not None else 0,
        host_cache_misses=host_cache.misses if host_cache is not None else 0,
        lookahead_hits=cost.lookahead[0] if cost.lookahead else None,
        lookahead_misses=cost.lookahead[1] if cost.lookahead else None,
        lookahead_wasted_bytes_per_token=cost.lookahead[2] / n if cost.lookahead else None)
