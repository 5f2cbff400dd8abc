"""The host-memory cache of disk-tier experts at run time (`load(host_cache_gb=...)`, run/host_cache.py).

Model: fixtures_models.SIZES qwen3_moe (float32, hidden 32, 2 layers, E=6, top-2): one expert is 12,288 B of
gate_up_proj + 6,144 B of down_proj = 18,432 B per layer; one embedding row is 128 B.

Plans (`disk_plan`), made from a zero-budget plan, the embedding on disk (a decode step then reads one 128 B row
from disk besides its experts: the dense disk bytes):
    whole   every routed-expert tensor on disk, whole (12 disk experts of 18,432 B)
    split   gate_up_proj experts 1, 3, 4 and down_proj experts 1, 4 on disk, the others resident (a disk-tier
            split tensor; experts 1 and 4 have 18,432 disk bytes, expert 3 12,288)

What is checked: tokens and logits bit-identical to the same plan without the host cache (both layouts, both
backends); a bigger cache reads fewer bytes from disk and more from host memory, and one holding every disk
expert reads no routed expert from disk once it has seen them; hits, misses and bytes equal replay's on the
generation's own trace (lru, lfu, heat; and with a device cache above it); the carve out of the host budget;
refused sizes; after evictions each cached row is one run of pages (read in place); a prefill keeps its most
picked disk experts in free pages (exact rows) and reads as without the cache; a plan with nothing on disk leaves
it empty.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import moe_offload as mo
from fixtures_models import BACKENDS, SIZES, load, prompt_ids
from moe_offload.errors import BudgetError
from moe_offload.formats.traces import TraceWriter, read_trace
from moe_offload.loading.loader import load_tokenizer
from moe_offload.measure.profile import record, trace_header
from moe_offload.planning.placement import GiB, Tier
from moe_offload.routing.replay import replay
from moe_offload.tiny.make import make_tiny

EXPERT = 18432     # one expert's bytes over both routed tensors of a layer
ROW = 128          # one embedding row
NEW = 10
SPLIT_IDS = {"gate_up_proj": (1, 3, 4), "down_proj": (1, 4)}


def gb(nbytes: int) -> float:
    return nbytes / GiB    # exact in binary: load's int(gb * GiB) gives back nbytes


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("host-cache") / "qwen3_moe", family="qwen3_moe", **SIZES)


def disk_plan(folder, layout: str):
    def place(t):
        if t.role == "embedding" or (t.role == "routed_expert" and layout == "whole"):
            return dataclasses.replace(t, tier=Tier.DISK.value)
        if t.role == "routed_expert":
            ids = SPLIT_IDS[t.name.rpartition(".")[2]]
            return dataclasses.replace(t, tier=Tier.DISK.value, host_experts=len(ids), host_expert_ids=ids)
        return t

    p0 = mo.plan(folder, offload_gb=0)
    return dataclasses.replace(p0, tensors=tuple(place(t) for t in p0.tensors))


def generate(model, ids, new_tokens: int = NEW):
    """(greedy tokens, per-step logits, prefill logits), EOS ignored so that every step decodes."""
    mask = torch.ones_like(ids)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, eos_token_id=[],
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        prefill = model(input_ids=ids, attention_mask=mask).logits
    return out.sequences, torch.cat(out.logits), prefill


def decode_disk_bytes(rt) -> list[int]:
    """The disk counter of every decode call, in order."""
    return [b for (n, b), dec in zip(rt.disk_counter.calls, rt.disk_counter.decode) if n == 1 and dec]


@pytest.mark.exact
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["whole", "split"])
def test_outputs_equal_the_same_plan_without_the_host_cache(folder, layout, backend):
    plan = disk_plan(folder, layout)
    ids = prompt_ids(folder, 8)
    plain, _ = load(folder, plan=plan, backend=backend)
    want = generate(plain, ids)
    model, _ = load(folder, plan=plan, backend=backend, host_cache_gb=gb(4 * EXPERT))
    got = generate(model, ids)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    stats = model.moe_offload_runtime.host_cache.stats()
    # the cached path was taken both ways: rows served from host memory and rows stored into it
    assert stats["host_cache_hits"] > 0 and stats["host_cache_misses"] > 0, stats
    assert model.moe_offload_runtime.disk_counter.decode_bytes_per_token() < \
        plain.moe_offload_runtime.disk_counter.decode_bytes_per_token()


def test_a_bigger_cache_reads_less_from_disk_and_more_from_host_memory(folder):
    plan = disk_plan(folder, "whole")
    ids = prompt_ids(folder, 8)
    seen = []
    for experts in (None, 4, 5):    # lru keeps what a smaller lru keeps (a stack policy): monotone
        model, _ = load(folder, plan=plan, host_cache_gb=None if experts is None else gb(experts * EXPERT),
                        cache_policy=None if experts is None else "lru")
        generate(model, ids)
        rt = model.moe_offload_runtime
        seen.append((rt.disk_counter.decode_bytes_per_token(), rt.counter.decode_bytes_per_token()))
    disk, host = zip(*seen)
    assert host[0] == 0 and all(a > b for a, b in zip(disk, disk[1:])), seen
    assert all(a < b for a, b in zip(host, host[1:])), seen
    assert len({d + h for d, h in seen}) == 1, seen      # the same bytes, read from another tier


def test_after_evictions_every_cached_row_is_one_run_of_pages_read_in_place(folder):
    """gate_up_proj's row is two pages, down_proj's one: a victim's three pages go to the next expert admitted,
    each of its rows in one run (host_cache.run_start), so hits are read in place, not copied page by page."""
    model, _ = load(folder, plan=disk_plan(folder, "whole"), host_cache_gb=gb(4 * EXPERT), cache_policy="lru")
    generate(model, prompt_ids(folder, 8), 30)
    cache = model.moe_offload_runtime.host_cache
    stats = cache.stats()
    assert stats["host_cache_evictions"] > 0 and stats["host_cache_hits"] > 0, stats
    rows = [pages for held in cache.pages.held.values() for pages in held if pages]
    assert len(rows) == 2 * len(cache.contents()) and all(cache.run_start(list(p)) is not None for p in rows), rows


def test_a_cache_of_every_disk_expert_reads_no_routed_expert_from_disk_once_it_has_seen_them(folder):
    plan = disk_plan(folder, "whole")
    ids = prompt_ids(folder, 8)
    model, _ = load(folder, plan=plan, host_cache_gb=gb(12 * EXPERT))
    rt = model.moe_offload_runtime
    with torch.no_grad():
        model(input_ids=ids)                   # a prefill alone: what it leaves in the cache
    left = len(rt.host_cache.contents())
    assert 0 < left <= 12 and (rt.host_cache.policy.hits, rt.host_cache.policy.misses) == (0, 0)
    generate(model, ids)
    first = rt.host_cache.stats()
    # each expert read from disk once on the decode path: every miss was admitted beside what the prefill left
    assert first["host_cache_misses"] == len(rt.host_cache.contents()) - left
    prefill_disk = rt.disk_counter.calls[0][1]
    rt.disk_counter.reset()
    # The same prompt again routes the same experts: every decode step finds them all in host memory.
    generate(model, ids)
    assert decode_disk_bytes(rt) == [ROW] * (NEW - 1)      # only the new token's embedding row
    assert rt.host_cache.stats()["host_cache_misses"] == first["host_cache_misses"]
    assert rt.disk_counter.calls[0][1] == prefill_disk     # a prefill reads as without the cache


@pytest.mark.parametrize("policy", ["lru", "lfu", "heat"])
def test_hits_misses_and_bytes_equal_replay_of_the_generations_own_trace(folder, tmp_path, policy):
    plan = disk_plan(folder, "split")   # experts of two sizes: replay's bytes per access are checked too
    size = gb(3 * EXPERT)
    model, plan = load(folder, plan=plan, host_cache_gb=size, cache_policy=policy)
    rt = model.moe_offload_runtime
    path = tmp_path / "trace.jsonl"
    with TraceWriter(path, trace_header(plan, "test")) as writer:
        record(model, load_tokenizer(folder), ["The storm reached the coast", "Seven ships left the harbour"],
               writer, max_new_tokens=12, ignore_eos=True)
    r = replay(plan, read_trace(path), host_cache_gb=size, cache_policy=policy)
    stats = rt.host_cache.stats()
    assert r.tokens == 24 and r.host_cache_policy == policy and r.host_cache_bytes == 3 * EXPERT
    assert (r.host_cache_hits, r.host_cache_misses) == (stats["host_cache_hits"], stats["host_cache_misses"])
    assert r.host_cache_hits > 0 and r.host_cache_misses > 0
    assert r.disk_read_bytes_per_token == rt.disk_counter.decode_bytes_per_token()
    assert r.host_link_bytes_per_token == rt.counter.decode_bytes_per_token() > 0


def test_runtime_equals_replay_with_a_device_cache_above_the_host_cache(folder, tmp_path):
    """Layer 0's experts on the host tier, layer 1's on disk, a device cache and a host cache (lru, 4 experts each):
    the runtime's counts and bytes equal replay's of the same generation, which puts the host cache below the
    device cache (it sees the device cache's misses of disk experts)."""
    p0 = mo.plan(folder, offload_gb=0)
    plan = dataclasses.replace(p0, tensors=tuple(
        dataclasses.replace(t, tier=(Tier.HOST if t.layer == 0 else Tier.DISK).value) if t.role == "routed_expert"
        else t for t in p0.tensors))
    size = gb(4 * EXPERT)
    model, plan = load(folder, plan=plan, cache_gb=size, host_cache_gb=size, cache_policy="lru")
    rt = model.moe_offload_runtime
    path = tmp_path / "trace.jsonl"
    with TraceWriter(path, trace_header(plan, "test")) as writer:
        record(model, load_tokenizer(folder), ["The storm reached the coast"], writer, max_new_tokens=12,
               ignore_eos=True)
    r = replay(plan, read_trace(path), cache_gb=size, host_cache_gb=size, cache_policy="lru")
    device, host = rt.cache.policy, rt.host_cache.policy
    got = dict(cache=(device.hits, device.misses), host_cache=(host.hits, host.misses),
               disk=rt.disk_counter.decode_bytes_per_token(), host_link=rt.counter.decode_bytes_per_token())
    want = dict(cache=(r.cache_hits, r.cache_misses), host_cache=(r.host_cache_hits, r.host_cache_misses),
                disk=r.disk_read_bytes_per_token, host_link=r.host_link_bytes_per_token)
    assert got == want, f"runtime {got} != replay {want}"
    assert device.hits > 0 and host.hits + host.misses > 0   # both levels took part


# --- the carve out of the host budget ------------------------------------------------------------------------

def _tiers(plan):
    return [(t.name, t.tier, t.host_expert_ids) for t in plan.tensors]


def _host_bytes(plan):
    return sum(t.offloaded_bytes for t in plan.tensors if t.tier == Tier.HOST)


def test_the_host_cache_comes_out_of_host_memory(folder):
    p0 = mo.plan(folder, offload_gb=0)
    device, host, cache = gb(p0.total_bytes // 3), gb(p0.total_bytes // 3), gb(4 * EXPERT)
    budget = dict(device_memory_gb=device + 1, reserve_gb=1, cpu_only=True)   # 1 GiB: the process's own
    model, plan = load(folder, host_memory_gb=host, host_cache_gb=cache, **budget)
    want = mo.plan(folder, host_memory_gb=host - cache, **budget)
    assert _tiers(plan) == _tiers(want) and _host_bytes(plan) == _host_bytes(want)
    # the carve moved something: without it the host tier holds more
    assert _host_bytes(mo.plan(folder, host_memory_gb=host, **budget)) > _host_bytes(plan)
    assert any("host cache" in n and "host memory" in n for n in plan.notes), plan.notes
    assert model.moe_offload_runtime.host_cache.capacity_bytes == 4 * EXPERT


def test_cpu_only_the_host_cache_comes_out_of_the_reserve_not_the_weights(folder):
    """CPU-only with device_memory_gb alone the device is RAM: the cache lives in the reserve kept beside the
    weights (as the device cache does, device_cache.reserve_note), so the weights get no more RAM than without it
    and weights + cache stay within device_memory_gb."""
    p0 = mo.plan(folder, offload_gb=0)
    device, reserve, cache = gb(p0.total_bytes // 2) + 1, 1 + gb(5 * EXPERT), gb(4 * EXPERT)   # + the process's GiB
    budget = dict(device_memory_gb=device, reserve_gb=reserve, cpu_only=True)
    without = mo.plan(folder, **budget)
    model, plan = load(folder, host_cache_gb=cache, **budget)
    assert any("host cache" in n and "reserve" in n for n in plan.notes), plan.notes
    held = plan.resident_bytes + model.moe_offload_runtime.host_cache.host_bytes
    assert without.resident_bytes > 0
    assert plan.resident_bytes <= without.resident_bytes and held <= device * GiB, (
        f"with host_cache_gb the plan keeps {plan.resident_bytes} B of weights resident (without it "
        f"{without.resident_bytes} B); weights + host cache = {held} B, device_memory_gb = {int(device * GiB)} B: "
        "host_cache.carve passes reserve_gb - host_cache_gb to the planner, which widens the weights' room by the "
        "cache instead of keeping the cache in the reserve")


def test_a_host_cache_larger_than_its_budget_is_refused(folder):
    budget = dict(device_memory_gb=gb(40 * EXPERT), cpu_only=True)
    with pytest.raises(BudgetError, match="host-cache-gb"):
        load(folder, host_memory_gb=gb(4 * EXPERT), host_cache_gb=gb(5 * EXPERT), **budget)
    with pytest.raises(BudgetError, match="host-cache-gb"):
        load(folder, reserve_gb=gb(4 * EXPERT), host_cache_gb=gb(5 * EXPERT), **budget)


def test_cpu_only_the_host_cache_must_fit_beside_the_process_in_the_reserve(folder):
    """The reserve of a CPU-only plan also holds the process itself (measured, hundreds of MiB): a host cache that
    fits in the reserve alone but not beside the process is refused, with both named."""
    device = gb(mo.plan(folder, offload_gb=0).total_bytes // 3) + 1
    with pytest.raises(BudgetError, match=r"does not fit in the 1 GiB reserve beside the process itself \(.*measured\)"):
        load(folder, device_memory_gb=device, reserve_gb=1, cpu_only=True, host_cache_gb=0.9)


def test_a_host_cache_smaller_than_one_disk_expert_is_refused_at_load(folder):
    with pytest.raises(BudgetError, match=r"--host-cache-gb.*cannot hold one disk expert|"
                                          r"cannot hold one disk expert.*--host-cache-gb"):
        load(folder, plan=disk_plan(folder, "whole"), host_cache_gb=gb(EXPERT - 1))
    # exactly one expert is enough
    model, _ = load(folder, plan=disk_plan(folder, "whole"), host_cache_gb=gb(EXPERT))
    assert model.moe_offload_runtime.host_cache.host_bytes == EXPERT


def test_a_prefill_leaves_its_most_picked_disk_experts_in_free_pages_and_reads_as_without_the_cache(folder):
    """A prefill is no host-cache access (no hit, no miss, every disk expert read from disk), but per layer its
    most picked experts stay in free pages, within the layer's share of the capacity, their rows exact."""
    ids = prompt_ids(folder, 8)
    plain, _ = load(folder, plan=disk_plan(folder, "whole"))
    model, _ = load(folder, plan=disk_plan(folder, "whole"), host_cache_gb=gb(5 * EXPERT))
    resident, _ = load(folder, offload_gb=0)
    rt = model.moe_offload_runtime
    picked = {}
    rt.recorder = lambda call: picked.update({k: v.reshape(-1).tolist() for k, v in call.experts.items()})
    with torch.no_grad():
        plain(input_ids=ids)
        model(input_ids=ids)
    cache = rt.host_cache
    assert (cache.policy.hits, cache.policy.misses, cache.policy.evictions) == (0, 0, 0)
    assert rt.disk_counter.calls[-1][1] == plain.moe_offload_runtime.disk_counter.calls[-1][1] > 0
    kept = cache.contents()
    share = 5 * EXPERT // 2                       # two layers on disk: 2 experts each
    for layer in (0, 1):
        mine = sorted(e for lay, e in kept if lay == layer)
        counts = [picked[layer].count(e) for e in range(6)]
        ranked = sorted((e for e in range(6) if counts[e]), key=lambda e: (-counts[e], e))
        assert mine == sorted(ranked[:share // EXPERT]), (layer, counts, mine)
        experts = resident.model.layers[layer].mlp.experts
        for e in mine:
            for name, pages in zip(cache._layers[layer].names, cache.pages.held[(layer, e)]):
                want = getattr(experts, name)[e]
                got = torch.empty_like(want)
                cache.read(list(pages), got)
                assert torch.equal(got, want), (layer, e, name)
    # a second prefill finds no free room beyond the shares: nothing evicted, nothing more kept
    with torch.no_grad():
        model(input_ids=ids.flip(-1))
    assert cache.policy.evictions == 0 and cache.policy.used_bytes <= 5 * EXPERT


def test_a_plan_with_nothing_on_disk_leaves_the_host_cache_empty(folder):
    p0 = mo.plan(folder, offload_gb=0)
    model, plan = load(folder, offload_gb=gb(p0.total_bytes // 2), host_cache_gb=gb(4 * EXPERT))
    assert not any(t.tier == Tier.DISK for t in plan.tensors) and plan.offloaded_bytes > 0
    rt = model.moe_offload_runtime
    generate(model, prompt_ids(folder, 8))
    assert rt.host_cache.host_bytes == 0 and rt.host_cache.contents() == set()
    assert (rt.host_cache.policy.hits, rt.host_cache.policy.misses) == (0, 0)
    assert rt.disk_counter.decode_bytes_per_token() == 0 and rt.counter.decode_bytes_per_token() > 0
