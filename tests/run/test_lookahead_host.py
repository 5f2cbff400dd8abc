"""The look-ahead of host-tier experts (`load(lookahead=N)`, run/lookahead.py): predicted experts the device cache
lacks are copied to the device before their layer routes (CPU-only: by a worker thread; an accelerator: on the
side stream), and taken from those rows when picked; what is computed never changes, only when it is copied.

Model: make_tiny qwen3_moe, float32, hidden 32, 4 layers, E=8, top-2. One expert is 12,288 B of gate_up_proj
+ 6,144 B of down_proj = 18,432 B per layer.

Plans (layer 0 stays resident in all but `mixed`: it has no layer before it to be predicted from):
    host    the routed tensors of layers 1-3 on the host tier, whole
    split   the routed tensors of layers 1-3 split: gate_up_proj experts 1, 3, 4, 6 and down_proj 1, 4 on the host
    mixed   every layer's gate_up_proj on the host tier, its down_proj on the disk tier (one layer, two tiers)

What is checked: tokens, logits and per-call link and disk bytes equal lookahead=0's for N = 1, 2 (both backends,
with and without a device cache); hits + misses are the decode steps' host reads counted from the recorded
routing; a predictor replaying that routing hits every read and wastes nothing, one predicting only unpicked
experts hits nothing and wastes exactly its copies (host copies are never cancelled); replay of a predicted trace
counts what the runtime counted, with a device cache above the host tier.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import moe_offload as mo
from fixtures_lookahead import E, EXPERT, LAYERS, NEW, SPLIT_IDS, Replay, generate, routing, tiny_model
from fixtures_models import BACKENDS, load, prompt_ids
from moe_offload.formats.traces import TraceWriter, read_trace
from moe_offload.loading.loader import load_tokenizer
from moe_offload.measure.profile import record, trace_header
from moe_offload.planning.placement import GiB, Tier
from moe_offload.routing.replay import replay



@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("lookahead-host") / "m")


def _plan(folder, kind: str):
    p0 = mo.plan(folder, offload_gb=0)

    def place(t):
        if t.role != "routed_expert":
            return t
        local = t.name.rpartition(".")[2]
        if kind == "mixed":
            return dataclasses.replace(t, tier=(Tier.DISK if local == "down_proj" else Tier.HOST).value)
        if t.layer == 0:
            return t
        if kind == "split":
            ids = SPLIT_IDS[local]
            return dataclasses.replace(t, tier=Tier.HOST.value, host_experts=len(ids), host_expert_ids=ids)
        return dataclasses.replace(t, tier=Tier.HOST.value)
    return dataclasses.replace(p0, tensors=tuple(place(t) for t in p0.tensors))


@pytest.fixture(scope="module")
def plans(folder):
    return {k: _plan(folder, k) for k in ("host", "split", "mixed")}


def test_the_plans_put_experts_where_the_docstring_says(plans):
    host = [t for t in plans["host"].tensors if t.tier == Tier.HOST]
    assert {t.layer for t in host} == {1, 2, 3} and all(t.role == "routed_expert" for t in host)
    split = [t for t in plans["split"].tensors if t.tier == Tier.HOST]
    assert all(0 < len(t.host_ids) < E for t in split)
    mixed = {t.name.rpartition(".")[2]: t.tier for t in plans["mixed"].tensors if t.layer == 2
             and t.role == "routed_expert"}
    assert mixed == {"gate_up_proj": Tier.HOST, "down_proj": Tier.DISK}


@pytest.mark.exact
@pytest.mark.parametrize("cache", [False, True], ids=["no-cache", "device-cache"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["host", "split", "mixed"])
def test_outputs_and_bytes_equal_lookahead_0(folder, plans, kind, backend, cache):
    ids = prompt_ids(folder, 8)
    extra = dict(cache_gb=3 * EXPERT / GiB) if cache else {}
    seen = {}
    for n in (0, 1, 2):
        model, _ = load(folder, plan=plans[kind], backend=backend, lookahead=n, **extra)
        rt = model.moe_offload_runtime
        out = generate(model, ids)
        dc = (rt.cache.policy.hits, rt.cache.policy.misses) if cache else None
        disk = list(rt.disk_counter.calls) if rt.disk is not None else None
        seen[n] = (out, list(rt.counter.calls), disk, dc)
        if n == 0:
            assert rt.lookahead is None
            continue
        la = rt.lookahead
        # the look-ahead copied host rows and some were taken (else `take_host` would not be exercised)
        assert la.predicted > 0 and la.hits > 0, la.stats(NEW - 1)
        (tokens, logits), link, disk, counts = seen[n]
        (tokens0, logits0), link0, disk0, counts0 = seen[0]
        assert torch.equal(tokens, tokens0), f"lookahead={n}: tokens differ"
        assert torch.equal(logits, logits0), f"lookahead={n}: logits differ"
        assert link == link0, f"lookahead={n}: per-call host-link bytes differ"
        assert disk == disk0, f"lookahead={n}: per-call disk bytes differ"
        assert counts == counts0, f"lookahead={n}: device cache hits/misses differ"
    if cache:
        assert seen[0][3][0] > 0 and seen[0][3][1] > 0      # both paths of the device cache were taken


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_perfect_predictor_copies_every_read_ahead_and_a_wrong_one_none(folder, plans, backend):
    ids = prompt_ids(folder, 8)
    model, _ = load(folder, plan=plans["host"], backend=backend, lookahead=1)
    rt, la = model.moe_offload_runtime, model.moe_offload_runtime.lookahead
    recorded = routing(rt)
    want = generate(model, ids)
    # host reads of the decode steps: every selected expert of layers 1-3 (whole host tensors, no cache)
    reads = sum(torch.unique(c.experts[layer]).numel() for c in recorded if c.decode for layer in range(1, LAYERS))
    assert la.hits + la.misses == reads and la.per_layer[1][0] + la.per_layer[1][1] > 0

    la.reset()
    la.predictor = Replay(recorded, rt, E)
    got = generate(model, ids)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert (la.hits, la.misses, la.wasted_bytes, la.cancelled_bytes) == (reads, 0, 0, 0), la.stats(NEW - 1)
    assert la.predicted == reads

    la.reset()
    la.predictor = Replay(recorded, rt, E, invert=True)
    got = generate(model, ids)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert (la.hits, la.misses) == (0, reads)
    # host copies are short and never cancelled: every wrong guess is copied in full
    assert la.predicted > 0 and la.wasted_bytes == la.predicted * EXPERT and la.cancelled_bytes == 0


def test_with_a_device_cache_only_its_misses_are_predicted_reads(folder, plans):
    """A predicted expert the device cache holds is not copied ahead; hits + misses are the cache's misses. The
    cache holds every offloaded expert (no eviction), so that all it missed had been predicted."""
    ids = prompt_ids(folder, 8)
    model, _ = load(folder, plan=plans["host"], lookahead=1, cache_gb=(LAYERS - 1) * E * EXPERT / GiB)
    rt, la = model.moe_offload_runtime, model.moe_offload_runtime.lookahead
    recorded = routing(rt)
    la.predictor = Every = type("Every", (), {"covers": lambda self, layer: layer > 0,
                                              "predict": lambda self, layer, hidden: list(range(E))})()
    generate(model, ids)
    assert Every is la.predictor
    cache = rt.cache.policy
    assert cache.evictions == 0 and cache.hits > 0 and la.hits + la.misses == cache.misses
    assert la.misses == 0                                   # every expert predicted: every miss read ahead
    decode_layers = sum(1 for c in recorded if c.decode) * (LAYERS - 1)
    # what the cache held was not copied: fewer copies than every expert of every predicted layer step
    assert la.predicted < decode_layers * E


@pytest.mark.parametrize("cache_gb", [None, 3 * EXPERT / GiB], ids=["no-cache", "device-cache"])
@pytest.mark.parametrize("kind", ["host", "mixed"])
def test_replay_of_a_predicted_trace_counts_what_the_runtime_counted(folder, plans, tmp_path, kind, cache_gb):
    """`mixed`: a guess reads a host row and a disk row of one expert, each counted once."""
    model, plan = load(folder, plan=plans[kind], lookahead=1, cache_gb=cache_gb)
    path = tmp_path / "t.jsonl"
    with TraceWriter(path, trace_header(plan, "test")) as w:
        record(model, load_tokenizer(folder), ["The storm reached the coast", "A river"], w, max_new_tokens=10,
               ignore_eos=True, predict=True)
    got = replay(plan, read_trace(path), cache_gb=cache_gb)
    st = model.moe_offload_runtime.lookahead.stats(got.tokens)
    assert (got.lookahead_hits, got.lookahead_misses) == (st["lookahead_hits"], st["lookahead_misses"])
    assert got.lookahead_hits > 0 and got.lookahead_misses > 0
    runtime_guessed = st["lookahead_wasted_bytes_per_token"] + st["lookahead_cancelled_bytes_per_token"]
    assert got.lookahead_wasted_bytes_per_token == pytest.approx(runtime_guessed, rel=1e-12)
    if cache_gb:
        assert got.cache_hits > 0
