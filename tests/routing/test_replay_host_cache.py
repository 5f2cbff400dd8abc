"""`replay(host_cache_gb=...)`: the host-memory cache of disk-tier experts below the device cache, counted by hand.

The planner's toy model (tests/fixtures_records.py: bfloat16, E=4, top-k 2): one expert is gate_up 128 B + down
64 B = 192 B per layer. Plans are a zero-budget plan with tensors moved to the disk or host tier by hand.

The trace is test_replay.py's: decode tokens, in the order a cache sees them (per token, per layer, ascending id):
    token 1   (0,0) (0,1) (1,2) (1,3)
    token 2   (0,1) (0,2) (1,0)          (layer 1 dropped a pick)
    token 3   (0,0) (0,3) (1,1) (1,2)
11 accesses of 8 distinct experts; a cache that holds them all hits 3 times: (0,1) at token 2, (0,0) and (1,2)
at token 3. TRACE is those decode rows alone; WITH_PREFILL has the prompt's prefill row before them (experts 0 and 1
in both layers), whose reads the host cache keeps in its free room (leave_prefill): counted by hand below too.
"""

from __future__ import annotations

import dataclasses

import pytest

from moe_offload.errors import MoeOffloadError
from moe_offload.formats.traces import Trace, TraceHeader, TraceRow, routing_array
from moe_offload.planning.placement import Tier
from moe_offload.planning.planner import plan
from moe_offload.routing.replay import ReplayResult, access_keys, replay, replay_routing
from fixtures_records import EMBED, FINAL_NORM, LM_HEAD, gb, layer, make_inv

INV = make_inv([EMBED, *layer(0), *layer(1), FINAL_NORM, LM_HEAD])
EXPERT = 192
ROWS = (
    TraceRow(0, 0, "prefill", ((0, 1), (0, 1))),   # prefill: not replayed, but what it leaves in the host cache is
    TraceRow(0, 1, "decode", ((1, 0), (2, 3))),
    TraceRow(0, 2, "decode", ((1, 2), (0,))),
    TraceRow(0, 3, "decode", ((3, 0), (2, 1))),
)
TRACE = Trace(TraceHeader("qwen3_moe", 4, 2, (0, 1)), ROWS[1:], "hand.jsonl")
WITH_PREFILL = Trace(TRACE.header, ROWS, "hand-prefill.jsonl")
ALL = gb(8 * EXPERT)     # every expert of both layers


def tiered(tier_of):
    """The zero-budget plan with each routed-expert tensor t in tier `tier_of(t)` (None: resident)."""
    p0 = plan(INV, offload_gb=0)
    return dataclasses.replace(p0, tensors=tuple(
        dataclasses.replace(t, tier=tier_of(t).value) if t.role == "routed_expert" and tier_of(t) else t
        for t in p0.tensors))


def on_disk():
    return tiered(lambda t: Tier.DISK)


def totals(r: ReplayResult) -> tuple[int, int]:
    """(host bytes, disk bytes) over the replayed tokens."""
    return round(r.host_link_bytes_per_token * r.tokens), round(r.disk_read_bytes_per_token * r.tokens)


@pytest.mark.parametrize("experts,hits", [(8, 3), (4, 1), (2, 0)])
def test_hits_move_exactly_their_disk_bytes_to_host_memory(experts, hits):
    # lru, by hand: 8 slots hit 3 times (above); 4 slots only (0,1) at token 2, every other key is evicted
    # before it comes back; 2 slots hold no key until it comes back
    p = on_disk()
    base = replay(p, TRACE)
    r = replay(p, TRACE, host_cache_gb=gb(experts * EXPERT), cache_policy="lru")
    assert totals(base) == (0, 11 * EXPERT)
    assert (r.host_cache_hits, r.host_cache_misses) == (hits, 11 - hits)
    assert totals(r) == (hits * EXPERT, (11 - hits) * EXPERT)
    assert r.link_bytes_per_token == base.link_bytes_per_token            # the same bytes, from another tier
    assert (r.host_cache_policy, r.host_cache_bytes) == ("lru", experts * EXPERT)
    # the host cache is no device cache: every pick still crosses to the device
    assert (r.expert_reads, r.cache_hits, r.cache_policy) == (11, 0, None)


def test_a_prefill_leaves_its_most_picked_experts_in_the_free_room():
    """lru. A cache of all 8: each layer's share is 4, the prefill leaves (0,0) (0,1) (1,0) (1,1); then token 1 hits
    (0,0) (0,1), token 2 (0,1) (1,0), token 3 (0,0) (1,1) (1,2): 7 hits, the 4 others miss (3 hits without the
    prefill). A cache of 2: a share of 1 expert per layer, ties to the lower id, (0,0) and (1,0); (0,0) hits at
    token 1, every other access evicts what comes back later: 1 hit, 10 misses. The bytes read stay the same."""
    p = on_disk()
    r = replay(p, WITH_PREFILL, host_cache_gb=ALL, cache_policy="lru")
    assert (r.host_cache_hits, r.host_cache_misses) == (7, 4)
    assert totals(r) == (7 * EXPERT, 4 * EXPERT)
    assert replay(p, TRACE, host_cache_gb=ALL, cache_policy="lru").host_cache_hits == 3
    small = replay(p, WITH_PREFILL, host_cache_gb=gb(2 * EXPERT), cache_policy="lru")
    assert (small.host_cache_hits, small.host_cache_misses) == (1, 10)
    assert r.link_bytes_per_token == small.link_bytes_per_token == replay(p, TRACE).link_bytes_per_token
    # host-tier experts are no host cache's: a prefill leaves nothing of them
    host = replay(tiered(lambda t: Tier.HOST), WITH_PREFILL, host_cache_gb=ALL, cache_policy="lru")
    assert (host.host_cache_hits, host.host_cache_misses) == (0, 0)


def test_the_host_cache_sees_only_disk_bytes():
    """Layer 0's gate_up_proj on the host and its down_proj on disk, layer 1 resident: the host cache is asked
    for layer 0's picks with their disk bytes (64 B), in the runtime's order; a hit reads them from host memory."""
    p = tiered(lambda t: None if t.layer == 1 else Tier.HOST if "gate_up" in t.name else Tier.DISK)
    tb = p.token_bytes()
    ids = routing_array(TRACE.decode_rows, 2, 2)
    seen = []

    class Recording:       # holds every key it has seen
        def begin_step(self):
            pass

        def access(self, key, nbytes):
            seen.append((key, nbytes))
            return any(k == key for k, _ in seen[:-1])

    cost = replay_routing(tb, ids, host_cache=Recording())
    assert seen == [((0, 0), 64), ((0, 1), 64), ((0, 1), 64), ((0, 2), 64), ((0, 0), 64), ((0, 3), 64)]
    assert [k for k, _ in seen] == access_keys(tb, ids, disk_only=True)
    # 2 hits: (0,1) and (0,0) read 64 B from host memory instead of disk; every pick's 128 B come from the host
    assert (cost.host_bytes, cost.disk_bytes) == (6 * 128 + 2 * 64, 4 * 64)


def test_a_host_cache_of_0_is_no_host_cache():
    p = on_disk()
    base, r = replay(p, TRACE), replay(p, TRACE, host_cache_gb=0)
    host_fields = {"host_cache_policy", "host_cache_bytes", "host_cache_hits", "host_cache_misses"}
    assert {k: v for k, v in r.to_dict().items() if k not in host_fields} == \
        {k: v for k, v in base.to_dict().items() if k not in host_fields}
    assert (r.host_cache_hits, r.host_cache_bytes) == (0, 0)


def test_the_host_cache_sees_only_device_cache_misses():
    """Both levels, lru, every expert on disk. A device cache of 4 experts holds (0,1) at token 2 (1 hit, nothing
    read); the host cache of 8 below it sees the 10 other accesses: it holds (0,0) and (1,2) at token 3 (2 hits),
    the 8 first uses miss. The same host cache alone would see all 11 and hit 3 times."""
    p = on_disk()
    r = replay(p, TRACE, cache_gb=gb(4 * EXPERT), host_cache_gb=ALL, cache_policy="lru")
    assert (r.cache_hits, r.cache_misses) == (1, 10)
    assert (r.host_cache_hits, r.host_cache_misses) == (2, 8)
    assert totals(r) == (2 * EXPERT, 8 * EXPERT)
    # a device cache that holds everything leaves the host cache only first uses: all misses
    r = replay(p, TRACE, cache_gb=ALL, host_cache_gb=ALL, cache_policy="lru")
    assert (r.cache_hits, r.host_cache_hits, r.host_cache_misses) == (3, 0, 8)
    assert totals(r) == (0, 8 * EXPERT)
    alone = replay(p, TRACE, host_cache_gb=ALL, cache_policy="lru")
    assert (alone.cache_hits, alone.host_cache_hits, alone.host_cache_misses) == (0, 3, 8)


def test_host_tier_experts_never_reach_the_host_cache():
    """Layer 0's experts on the host, layer 1's on disk: only layer 1's 5 picks are host-cache accesses (one
    hit: (1,2) at token 3); the device cache sees all 11 (and, too small to hold a key until it comes back,
    hits none)."""
    p = tiered(lambda t: Tier.HOST if t.layer == 0 else Tier.DISK)
    r = replay(p, TRACE, cache_gb=gb(2 * EXPERT), host_cache_gb=ALL, cache_policy="lru")
    assert (r.cache_hits, r.cache_misses) == (0, 11)
    assert (r.host_cache_hits, r.host_cache_misses) == (1, 4)
    assert totals(r) == (6 * EXPERT + EXPERT, 4 * EXPERT)


def test_belady_at_two_levels_is_refused_and_alone_is_the_optimum():
    p = on_disk()
    with pytest.raises(MoeOffloadError, match="belady at two cache levels"):
        replay(p, TRACE, cache_gb=ALL, host_cache_gb=ALL, cache_policy="belady")
    # alone, the offline optimum over the disk accesses: with 2 slots it keeps what comes back soonest
    best = replay(p, TRACE, host_cache_gb=gb(2 * EXPERT), cache_policy="belady")
    online = [replay(p, TRACE, host_cache_gb=gb(2 * EXPERT), cache_policy=c).host_cache_hits
              for c in ("lru", "lfu", "heat")]
    assert best.host_cache_policy == "belady" and best.host_cache_hits >= max(online) and best.host_cache_hits > 0


@pytest.mark.parametrize("size", [-1.0, -1e-9, float("nan"), float("inf")])
def test_a_host_cache_size_that_is_no_size_is_refused(size):
    with pytest.raises(MoeOffloadError, match="--host-cache-gb .* is not a size"):
        replay(on_disk(), TRACE, host_cache_gb=size)


def test_the_result_reports_the_host_cache():
    d = replay(on_disk(), TRACE, host_cache_gb=ALL, cache_policy="lfu").to_dict()
    assert (d["host_cache_policy"], d["host_cache_bytes"], d["host_cache_hits"], d["host_cache_misses"]) == \
        ("lfu", 8 * EXPERT, 3, 8)
    d = replay(on_disk(), TRACE).to_dict()
    assert (d["host_cache_policy"], d["host_cache_bytes"], d["host_cache_hits"], d["host_cache_misses"]) == \
        (None, 0, 0, 0)
