"""Expert cache policies: eviction order on hand-made traces, Belady against brute force, exact bytes.

Keys are (layer, expert). Consecutive accesses in one layer with ascending ids form one layer
step (its experts are never evicted for one another); every hand-made trace below says where
its steps are. Unless a test says otherwise every expert is 10 bytes, so a cache of 20 bytes
holds two experts.
"""

from __future__ import annotations

import functools
import random

import pytest

from moe_offload.routing.cache_policy import DEFAULT_CACHE_POLICY, POLICIES, HeatCache, cache_policy_names, make_cache
from moe_offload.errors import BudgetError, SelectorError
from fixtures_cli import QWEN3_CONFIG

A, B, C, D = (0, 0), (1, 0), (2, 0), (3, 0)  # one expert in each of four layers: every access its own step


def drive(cache, keys, nbytes=10):
    """Access every key; the hit/miss list and the keys each access evicted."""
    hits, evicted = [], []
    for k in keys:
        hits.append(cache.access(k, nbytes))
        evicted.append(cache.last_evicted)
    return hits, evicted


def test_lru_eviction_order():
    cache = make_cache("lru", 20)
    hits, evicted = drive(cache, [A, B, A, C, B, A, D, A])
    # A: miss [A]; B: miss [A B]; A: hit [B A]; C: evicts B [A C]; B: evicts A [C B]; A: evicts C [B A];
    # D: evicts B [A D]; A: hit.
    assert hits == [False, False, True, False, False, False, False, True]
    assert evicted == [(), (), (), (B,), (A,), (C,), (B,), ()]
    assert (cache.hits, cache.misses, cache.evictions, cache.declined) == (2, 6, 4, 0)
    assert cache.contents() == {A, D}


def test_lfu_eviction_order_counts_survive_eviction():
    cache = make_cache("lfu", 20)
    hits, evicted = drive(cache, [A, B, A, C, B, A, D, A])
    # counts after each access: A1; B1; A2 (hit); C1 evicts B (1 < A's 2); B2 evicts C (1 < 2, B's count
    # survived its eviction); A3 hit; D1 evicts B (2 < 3); A4 hit.  LRU missed the sixth access, LFU hits it.
    assert hits == [False, False, True, False, False, True, False, True]
    assert evicted == [(), (), (), (B,), (C,), (), (B,), ()]
    assert (cache.hits, cache.misses) == (3, 5)


def test_lfu_tie_break_is_least_recently_used():
    cache = make_cache("lfu", 20)
    _, evicted = drive(cache, [A, B, C, A])
    # C: A and B both count 1, A older -> A. A (count 2 now): B and C both 1, B older -> B.
    assert evicted == [(), (), (A,), (B,)]
    assert cache.contents() == {C, A}


def test_belady_evicts_farthest_next_use_and_bypasses():
    cache = make_cache("belady", 20, future=[A, B, C, A, C, B])
    hits, evicted = drive(cache, [A, B, C, A, C, B])
    # C at #2: next uses A #3, B #5, C #4 -> B is farthest: evict it, admit C; A, C hit; B misses and is
    # never used again, nor is anything else: declined (bypass).
    assert hits == [False, False, False, True, True, False]
    assert evicted == [(), (), (B,), (), (), ()]
    assert (cache.misses, cache.declined) == (4, 1)

    cache = make_cache("belady", 20, future=[A, B, A, C, B, A, D, A])
    hits, _ = drive(cache, [A, B, A, C, B, A, D, A])
    # C at #3: next uses A #5, B #4, C never -> C itself is farthest: bypassed; so are D (never again).
    assert hits == [False, False, True, False, True, True, False, True]
    assert cache.contents() == {A, B}


def test_heat_admits_only_what_is_hotter_than_its_victim():
    cache = make_cache("heat", 20)
    # Sweep 1 (layers ascending): A, B admitted; C is used in the same sweep, so it is exactly as hot as they
    # are, not hotter: declined. Sweep 2 (back to layer 2): C's second use makes it hotter than A and B (one
    # use each); the tie between them goes to the lower key, A.
    hits, evicted = drive(cache, [A, B, C, C])
    assert hits == [False] * 4
    assert evicted == [(), (), (), (A,)]
    assert (cache.declined, cache.sweeps) == (1, 2) and cache.contents() == {B, C}


@pytest.mark.parametrize("half_life,hits", [(1.0, [False, True, True]), (16.0, [False, False, False])])
def test_heat_decays_with_its_half_life(half_life, hits):
    # One slot. A is used in sweeps 1-3 (each access goes back to layer 0: a new sweep), then B in sweeps 4-6.
    # half-life 1:  A's heat at sweep 4 is 1/2 + 1/4 + 1/8 = 0.875 < 1, B's first use: B replaces A at once.
    # half-life 16: A's heat at sweeps 4, 5, 6 is 2.75, 2.64, 2.52 (x 2^(-1/16) a sweep); B's is 1, 1.96,
    #               2.88: B replaces A at its third use. (LFU's forced admission would take B at its first.)
    cache = HeatCache(10, half_life=half_life)
    a, b = (0, 1), (0, 0)
    drive(cache, [a, a, a])
    assert cache.sweeps == 3
    got, evicted = drive(cache, [b, b, b])
    assert got == hits
    assert [e for e in evicted if e] == [(a,)] and cache.contents() == {b}
    assert cache.declined == (0 if half_life == 1.0 else 2)


def test_belady_refuses_a_sequence_other_than_its_future():
    cache = make_cache("belady", 20, future=[A, B])
    cache.access(A, 10)
    with pytest.raises(ValueError, match="access #1"):
        cache.access(C, 10)


def test_a_layer_step_is_never_evicted_for_itself():
    # Layer 0 step {0, 1, 2} in a cache of two experts: the third is declined, not swapped for the first.
    for policy in cache_policy_names():
        cache = make_cache(policy, 20)
        hits, evicted = drive(cache, [(0, 0), (0, 1), (0, 2)] * 2)
        assert hits == [False, False, False, True, True, False], policy
        assert all(e == () for e in evicted), policy
        assert cache.declined == 2, policy

    # LFU would evict the newcomer (0, 0) (count 1) when (0, 1) arrives, but they are one step:
    # (2, 5) goes instead, the least used of the other residents.
    cache = make_cache("lfu", 20)
    drive(cache, [(1, 5), (2, 5)] * 3)
    hits, evicted = drive(cache, [(0, 0), (0, 1)])
    assert evicted == [((1, 5),), ((2, 5),)]
    assert cache.contents() == {(0, 0), (0, 1)}


def _random_trace(rng, layers, experts, tokens, top_k):
    keys = []
    for _ in range(tokens):
        for layer in range(layers):
            keys += [(layer, e) for e in sorted(rng.sample(range(experts), top_k))]
    return keys


@pytest.mark.parametrize("policy", cache_policy_names(offline=True))
def test_capacity_is_exact_with_mixed_sizes(policy):
    rng = random.Random(7)
    keys = _random_trace(rng, layers=2, experts=6, tokens=150, top_k=2)
    size = {(layer, e): 1000 + 37 * layer + 11 * e for layer in range(2) for e in range(6)}  # 1000..1092 bytes
    capacity = 5 * 1000 + 321  # between 4 and 5 experts
    cache = make_cache(policy, capacity, future=keys if policy == "belady" else None)
    for k in keys:
        before = cache.contents()
        hit = cache.access(k, size[k])
        after = cache.contents()
        assert hit == (k in before)
        assert cache.used_bytes == sum(size[x] for x in after) <= capacity
        assert after == (before - set(cache.last_evicted)) | ({k} if k in after else set())
        assert set(cache.last_evicted) <= before and k not in cache.last_evicted
        slots = [cache.slot(x) for x in after]
        assert len(set(slots)) == len(slots)
    assert cache.hits + cache.misses == len(keys)
    assert cache.hits > 0 and cache.evictions > 0


@pytest.mark.parametrize("policy", cache_policy_names())
def test_equal_sizes_fill_fixed_slots_and_reuse_the_victims(policy):
    rng = random.Random(3)
    keys = _random_trace(rng, layers=3, experts=8, tokens=200, top_k=2)
    capacity = 7 * 64 + 63  # seven 64-byte slots and change
    cache = make_cache(policy, capacity)
    for k in keys:
        before = {x: cache.slot(x) for x in cache.contents()}
        cache.access(k, 64)
        assert all(0 <= cache.slot(x) < 7 for x in cache.contents())
        if len(cache.last_evicted) == 1:
            assert cache.slot(k) == before[cache.last_evicted[0]]  # the device copy lands where the victim was


def test_zero_capacity_caches_nothing_and_an_expert_larger_than_the_cache_is_an_error():
    cache = make_cache(DEFAULT_CACHE_POLICY, 0)
    hits, _ = drive(cache, [A, A, B, A])
    assert hits == [False] * 4 and cache.contents() == set() and cache.declined == 4
    with pytest.raises(BudgetError, match=r"does not fit in a cache of 15 bytes.*at least 16 bytes"):
        make_cache("lru", 15).access(A, 16)
    with pytest.raises(BudgetError, match="whole number of bytes"):
        make_cache("lru", -1)


def test_policy_names_are_checked():
    with pytest.raises(SelectorError, match=r"unknown cache policy 'mru'.*lru, lfu.*belady"):
        make_cache("mru", 100)
    with pytest.raises(SelectorError, match="only `replay` has"):
        make_cache("belady", 100)
    with pytest.raises(SelectorError, match="takes no future"):
        make_cache("lru", 100, future=[A])
    assert DEFAULT_CACHE_POLICY in POLICIES and "belady" not in POLICIES


def test_invalidate_drops_the_copy_and_frees_its_slot():
    cache = make_cache("lru", 20)
    drive(cache, [A, B])
    slot = cache.slot(A)
    assert cache.invalidate(A) and not cache.invalidate(A)
    assert cache.contents() == {B} and cache.used_bytes == 10
    assert cache.access(A, 10) is False and cache.slot(A) == slot and cache.last_evicted == ()


def _optimal_misses(keys, slots):
    """Fewest misses over every admission and eviction choice (the floor belady must reach)."""
    @functools.lru_cache(maxsize=None)
    def best(i, held):
        if i == len(keys):
            return 0
        k = keys[i]
        if k in held:
            return best(i + 1, held)
        options = [best(i + 1, held)]  # bypass
        if len(held) < slots:
            options.append(best(i + 1, held | {k}))
        else:
            options += [best(i + 1, (held - {v}) | {k}) for v in held]
        return 1 + min(options)

    return best(0, frozenset())


def test_belady_matches_the_brute_force_optimum():
    rng = random.Random(0)
    for _ in range(400):
        layers, experts = rng.randint(1, 3), rng.randint(2, 4)
        keys, length = [], rng.randint(4, 12)
        while len(keys) < length:
            layer = rng.randrange(layers)
            keys += [(layer, e) for e in sorted(rng.sample(range(experts), rng.randint(1, min(2, experts))))]
        slots = rng.randint(1, 3)
        cache = make_cache("belady", slots * 10, future=keys)
        drive(cache, keys)
        assert cache.misses == _optimal_misses(tuple(keys), slots), (keys, slots)


# --- `moe-offload replay --cache-gb` --------------------------------------------------------------------

# Qwen3-MoE float32, hidden 32, 2 layers, E=4, top-k 2: one expert = gate_up 4096 B + down 2048 B = 6144 B.
CONFIG = QWEN3_CONFIG
EXPERT = 6144
# Layer 0 always picks experts 0 and 1; layer 1 alternates {0, 1} and {2, 3}. Accesses per token:
# (0,0) (0,1) (1,x) (1,y): four experts through a cache of two.
DECODE = [((0, 1), (0, 1)), ((0, 1), (2, 3)), ((0, 1), (0, 1)), ((0, 1), (2, 3))]


@pytest.fixture
def replay_files(tmp_path):
    from moe_offload.formats.traces import TraceHeader, TraceRow, write_trace

    (tmp_path / "config.json").write_text(__import__("json").dumps(CONFIG))
    rows = [TraceRow(0, 0, "prefill", ((2, 3), (2, 3)))]
    rows += [TraceRow(0, 1 + i, "decode", r) for i, r in enumerate(DECODE)]
    write_trace(tmp_path / "trace.jsonl", TraceHeader("qwen3_moe", 4, 2, (0, 1), "test"), rows)
    return tmp_path


def _replay(capsys, folder, *options):
    import json

    from moe_offload.cli.main import main

    rc = main([str(a) for a in ("replay", folder / "config.json", "--trace", folder / "trace.jsonl",
                                "--offload-gb", repr(2 * 4 * EXPERT / (1 << 30)), "--offload-params", "experts",
                                *options, "--json")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)


@pytest.mark.parametrize("policy,hits", [
    # lru: every access evicts the oldest, which is always needed next: 16 misses.
    ("lru", 0),
    # lfu: the newcomers of layer 1 evict layer 0's experts (ties of equal count go to the older), so it thrashes
    # as lru does: layer 0's counts (2, 3, ...) never protect them against a newcomer's forced admission.
    ("lfu", 0),
    # heat: (1, x) is never hotter than (0, 0) and (0, 1), which stay: 2 hits per token after the first.
    ("heat", 6),
    # belady: the same choice, by knowing it: layer 1's experts are always used later than layer 0's.
    ("belady", 6),
])
def test_replay_with_each_cache_policy(replay_files, capsys, policy, hits):
    cache_gb = repr((2 * EXPERT + EXPERT // 2) / (1 << 30))   # two experts and a half: holds two
    doc = _replay(capsys, replay_files, "--cache-gb", cache_gb, "--cache-policy", policy)
    misses = 16 - hits
    assert (doc["cache_hits"], doc["cache_misses"], doc["expert_reads"]) == (hits, misses, misses)
    assert doc["cache_policy"] == policy and doc["cache_bytes"] == 2 * EXPERT + EXPERT // 2
    assert doc["tokens"] == 4 and doc["link_bytes_per_token"] == misses * EXPERT / 4


def test_replay_cache_defaults(replay_files, capsys):
    doc = _replay(capsys, replay_files, "--cache-gb", repr(2.5 * EXPERT / (1 << 30)))
    assert doc["cache_policy"] == DEFAULT_CACHE_POLICY
    none = _replay(capsys, replay_files)
    assert (none["cache_policy"], none["cache_bytes"], none["cache_hits"], none["expert_reads"]) == (None, 0, 0, 16)
    zero = _replay(capsys, replay_files, "--cache-gb", "0", "--cache-policy", "lru")
    assert (zero["cache_bytes"], zero["cache_hits"], zero["expert_reads"]) == (0, 0, 16)


def test_replay_cache_errors_exit_2(replay_files, capsys):
    from moe_offload.cli.main import main

    base = ["replay", str(replay_files / "config.json"), "--trace", str(replay_files / "trace.jsonl"),
            "--offload-params", "experts", "--offload-gb", "4e-5", "--json"]
    for extra, message in ((["--cache-gb", "1e-4", "--cache-policy", "mru"], "unknown cache policy 'mru'"),
                           (["--cache-gb", repr(100 / (1 << 30))], "does not fit in a cache of 100 bytes")):
        rc = main(base + extra)
        out, err = capsys.readouterr()
        assert rc == 2 and out == "" and err.startswith("error: ") and message in err, err


def test_marked_steps_keep_tokens_apart_where_the_order_cannot():
    # One offloaded layer, picks [0, 1], [2, 3], [2, 3], [2, 3], two slots (LRU). Without marks, rising ids in
    # one layer look like one step: token 2's experts would be protected with token 1's and declined. Marked:
    # token 1 misses 0, 1; token 2 evicts them for 2, 3 (misses); tokens 3 and 4 hit: 4 hits, 4 misses.
    for policy in ("lru", "lfu", "heat"):
        cache = make_cache(policy, 20)
        hits = []
        for picks in ([0, 1], [2, 3], [2, 3], [2, 3]):
            cache.begin_step()
            hits += [cache.access((5, e), 10) for e in picks]
        assert hits == [False, False, False, False, True, True, True, True], policy
        assert (cache.hits, cache.misses, cache.sweeps) == (4, 4, 4)


# --- what a prefill leaves: preload and prefill_keeps (run/host_cache.py and replay share them) ---------------------

@pytest.mark.parametrize("name", [*POLICIES, "belady"])
def test_a_preload_fills_free_room_only_and_is_no_access(name):
    future = [(0, 2), (0, 1), (0, 3)]
    c = make_cache(name, 2 * 10, future=future if name == "belady" else None)
    assert c.preload((0, 1), 10) and c.preload((0, 2), 10)
    assert not c.preload((0, 1), 10)                 # resident already
    assert not c.preload((0, 3), 10)                 # no free room: nothing is evicted for a preload
    assert c.contents() == {(0, 1), (0, 2)} and c.used_bytes == 20
    assert (c.hits, c.misses, c.evictions, c.clock, c.sweeps) == (0, 0, 0, 0, 0)
    c.begin_step()
    assert c.access((0, 2), 10) and c.access((0, 1), 10)   # then hits like any admitted expert
    c.begin_step()
    c.access((0, 3), 10)                             # a miss evicts a preloaded one as it would an admitted one
    assert c.misses == 1 and len(c.contents() & {(0, 1), (0, 2)}) == 2 - c.evictions


def test_belady_knows_a_preloaded_experts_next_use():
    # (0,3) comes back first, then (0,1), then (0,2): admitting (0,3), belady evicts (0,2), the farthest (were the
    # preloaded experts' next uses unknown, a tie would evict the lower key, (0,1))
    c = make_cache("belady", 2 * 10, future=[(0, 3), (0, 3), (0, 1), (0, 2)])
    c.preload((0, 1), 10)
    c.preload((0, 2), 10)
    c.begin_step()
    c.access((0, 3), 10)
    assert c.contents() == {(0, 1), (0, 3)}


def test_lfu_counts_a_preload_as_one_use():
    c = make_cache("lfu", 2 * 10)
    c.preload((0, 1), 10)                    # one use
    c.begin_step()
    c.access((0, 2), 10)                     # one use, more recent: (0,1) is the victim of the next miss
    c.begin_step()
    c.access((1, 3), 10)
    assert c.contents() == {(0, 2), (1, 3)}


def test_prefill_keeps_the_most_picked_within_the_room():
    from moe_offload.routing.expert_cache import prefill_keeps

    picks = [3, 0, 5, 3, 1, 2]
    nbytes = [10, 10, 10, 10, 0, 10]          # expert 4 has no cached bytes
    assert prefill_keeps(picks, nbytes, 0) == []
    assert prefill_keeps(picks, nbytes, 10) == [2]
    assert prefill_keeps(picks, nbytes, 25) == [0, 2]        # a tie (0 and 3, 3 picks each): the lower id
    assert prefill_keeps(picks, nbytes, 100) == [0, 2, 3, 5]  # never one not picked, nor one without bytes
    assert prefill_keeps([1, 1], [30, 10], 20) == [1]        # one that does not fit is passed over
