"""The look-ahead of disk-tier experts (`load(lookahead=N)`, run/lookahead.py): predicted experts are read on a
worker thread before their layer routes; what is read never changes, only when.

Model: make_tiny qwen3_moe, float32, hidden 32, 4 layers, E=8, top-2. One expert is 12,288 B of gate_up_proj
+ 6,144 B of down_proj = 18,432 B per layer.

Plans:
    budget  CPU-only device_memory plan of a third of the model, reserve 0: the embedding and the routed
            tensors of layers 0-2 on disk whole, layer 3's down_proj split (experts 6, 7 on disk)
    split   every routed tensor split: gate_up_proj experts 1, 3, 4, 6 and down_proj experts 1, 4 on disk
    all     every routed-expert tensor on disk, whole (nothing else)
    late    the routed tensors of layers 1-3 on disk, whole; layer 0 resident (so that every disk read of a
            decode step can be predicted: layer 0 has no earlier layer to predict it from)

What is checked: tokens, logits, per-call disk bytes and host-cache counts equal lookahead=0's for N = 1, 2, 3
(both backends, with and without a host cache); hits + misses are the decode steps' (layer, expert) disk
reads, counted from the recorded routing; a predictor replaying that routing hits every read and wastes
nothing, one predicting only unpicked experts hits nothing and wastes exactly its reads; layer 0 is never
predicted; a prefill predicts nothing; refused distances; a plan with nothing on disk has no look-ahead; a
look-ahead read of a truncated checkpoint raises CheckpointError in the forward that needs the row.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

import moe_offload as mo
from fixtures_lookahead import E, EXPERT, LAYERS, NEW, SPLIT_IDS, Replay, generate, routing, tiny_model
from fixtures_models import BACKENDS, load, prompt_ids
from moe_offload.errors import CheckpointError, MoeOffloadError
from moe_offload.planning.placement import GiB, Tier



@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("lookahead") / "m")


def _replaced(folder, place):
    p0 = mo.plan(folder, offload_gb=0)
    return dataclasses.replace(p0, tensors=tuple(place(t) for t in p0.tensors))


def _plan(folder, kind: str):
    if kind == "budget":
        total = mo.plan(folder, offload_gb=0).total_bytes
        return mo.plan(folder, device_memory_gb=total // 3 / GiB + 1, reserve_gb=1, cpu_only=True)
    if kind == "split":
        def place(t):
            if t.role != "routed_expert":
                return t
            ids = SPLIT_IDS[t.name.rpartition(".")[2]]
            return dataclasses.replace(t, tier=Tier.DISK.value, host_experts=len(ids), host_expert_ids=ids)
        return _replaced(folder, place)
    first = {"all": 0, "late": 1}[kind]
    return _replaced(folder, lambda t: dataclasses.replace(t, tier=Tier.DISK.value)
                     if t.role == "routed_expert" and t.layer >= first else t)


@pytest.fixture(scope="module")
def plans(folder):
    return {k: _plan(folder, k) for k in ("budget", "split", "all", "late")}


def _is_split(t) -> bool:
    return t.tier == Tier.DISK and t.role == "routed_expert" and 0 < len(t.host_ids) < t.shape[0]


def test_the_plans_hold_whole_and_split_disk_tensors(plans):
    budget = plans["budget"]
    disk = [t for t in budget.tensors if t.tier == Tier.DISK and t.role == "routed_expert"]
    assert any(not _is_split(t) for t in disk) and any(_is_split(t) for t in disk), \
        [(t.name, t.host_ids) for t in disk]
    split = [t for t in plans["split"].tensors if t.role == "routed_expert"]
    assert len(split) == 2 * LAYERS and all(_is_split(t) for t in split)


def _disk_reads(calls, layers) -> int:
    """(layer step, expert) reads of decode steps, every routed expert of `layers` on disk whole."""
    return sum(torch.unique(c.experts[layer]).numel() for c in calls if c.decode for layer in layers)


@pytest.mark.exact
@pytest.mark.parametrize("host_cache", [False, True], ids=["no-host-cache", "host-cache"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["budget", "split"])
def test_outputs_and_reads_equal_lookahead_0(folder, plans, kind, backend, host_cache):
    ids = prompt_ids(folder, 8)
    cache = dict(host_cache_gb=3 * EXPERT / GiB) if host_cache else {}
    seen = {}
    for n in (0, 1, 2, 3):
        model, _ = load(folder, plan=plans[kind], backend=backend, lookahead=n, **cache)
        rt = model.moe_offload_runtime
        out = generate(model, ids)
        hc = (rt.host_cache.policy.hits, rt.host_cache.policy.misses) if host_cache else None
        seen[n] = (out, list(rt.disk_counter.calls), hc)
        if n == 0:
            assert rt.lookahead is None
            continue
        assert rt.lookahead.distance == n
        # the look-ahead ran, and some of its rows were used (else the test would not exercise `take`)
        assert rt.lookahead.predicted > 0 and rt.lookahead.hits > 0, rt.lookahead.stats(NEW - 1)
        (tokens, logits), calls, counts = seen[n]
        (tokens0, logits0), calls0, counts0 = seen[0]
        assert torch.equal(tokens, tokens0), f"lookahead={n}: tokens differ"
        assert torch.equal(logits, logits0), f"lookahead={n}: logits differ"
        assert calls == calls0, f"lookahead={n}: per-call disk bytes differ"
        assert counts == counts0, f"lookahead={n}: host cache hits/misses differ"
    if host_cache:
        assert seen[0][2][0] > 0 and seen[0][2][1] > 0      # both paths of the host cache were taken


@pytest.mark.parametrize("n", [1, 2])
def test_hits_and_misses_are_the_decode_steps_disk_reads(folder, plans, n):
    model, _ = load(folder, plan=plans["all"], lookahead=n)
    rt = model.moe_offload_runtime
    asked = []
    inner = rt.lookahead.predictor

    class Spy:   # the default predictor, recording which layers it is asked about
        def covers(self, layer):
            return inner.covers(layer)

        def predict(self, layer, hidden):
            asked.append(layer)
            return inner.predict(layer, hidden)

    rt.lookahead.predictor = Spy()
    calls = routing(rt)
    rt.disk_counter.reset()
    generate(model, prompt_ids(folder, 8))
    reads = _disk_reads(calls, range(LAYERS))
    decode_bytes = [b for (t, b), dec in zip(rt.disk_counter.calls, rt.disk_counter.decode) if t == 1 and dec]
    assert sum(decode_bytes) == reads * EXPERT          # the two independent counts agree
    la = rt.lookahead
    assert la.hits + la.misses == reads and la.hits > 0
    assert sum(h + m for h, m in la.per_layer.values()) == reads
    # layer 0 has no earlier layer: never predicted, every one of its reads a miss
    assert asked and 0 not in asked and set(asked) == set(range(1, LAYERS))
    assert la.per_layer[0][0] == 0 and la.per_layer[0][1] > 0
    stats = la.stats(NEW - 1)
    assert stats["lookahead_recall"]["0"] in (0, None)
    assert set(stats["lookahead_recall"]) == {str(layer) for layer in range(LAYERS)}


@pytest.mark.parametrize("n", [1, 3])
def test_a_perfect_predictor_hits_every_read_and_a_wrong_one_none(folder, plans, n):
    ids = prompt_ids(folder, 8)
    # mmap: the readers count exactly the bytes asked (no O_DIRECT alignment), wasted reads included
    model, _ = load(folder, plan=plans["late"], lookahead=n, disk_read="mmap")
    rt, la = model.moe_offload_runtime, model.moe_offload_runtime.lookahead
    recorded = routing(rt)
    want = generate(model, ids)
    reads = _disk_reads(recorded, range(1, LAYERS))

    la.reset()
    la.predictor = perfect = Replay(recorded, rt, E)
    before = rt.disk.bytes_read
    got = generate(model, ids)
    assert perfect.asked > 0 and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert (la.hits, la.misses, la.wasted_bytes) == (reads, 0, 0), la.stats(NEW - 1)
    assert la.predicted == reads
    assert all(r == 1.0 for r in la.stats(NEW - 1)["lookahead_recall"].values())
    exact = rt.disk.bytes_read - before            # prefill + decode reads, nothing extra

    la.reset()
    la.predictor = wrong = Replay(recorded, rt, E, invert=True)
    before = rt.disk.bytes_read
    got = generate(model, ids)
    assert wrong.asked > 0 and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert (la.hits, la.misses) == (0, reads), la.stats(NEW - 1)
    # every guess is either read in vain or dropped before its read (when its layer routed first)
    assert la.predicted > 0 and la.wasted_bytes + la.cancelled_bytes == la.predicted * EXPERT
    # the wasted rows were really read, on top of the needed ones; the cancelled ones were not
    assert rt.disk.bytes_read - before == exact + la.wasted_bytes


def test_a_prefill_starts_no_lookahead_read(folder, plans):
    model, _ = load(folder, plan=plans["all"], lookahead=2)
    rt, la = model.moe_offload_runtime, model.moe_offload_runtime.lookahead
    calls = routing(rt)
    ids = prompt_ids(folder, 8)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True)                           # no cache given
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
        one = ids[:, :1]                                               # a one-token prompt: still a prefill
        model.generate(one, attention_mask=torch.ones_like(one), max_new_tokens=1, do_sample=False)
    assert len(calls) == 3 and not any(c.decode for c in calls)
    assert rt.disk_counter.calls and all(b > 0 for _, b in rt.disk_counter.calls)   # they did read from disk
    assert (la.predicted, la.hits, la.misses, la.wasted_bytes) == (0, 0, 0, 0)
    assert la.per_layer == {}


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_a_distance_that_is_no_number_of_layers_is_refused(folder, plans, bad):
    with pytest.raises(MoeOffloadError, match="lookahead"):
        load(folder, plan=plans["all"], lookahead=bad)


def test_nothing_offloaded_loads_without_a_lookahead(folder):
    """lookahead=N on a plan that offloads no routed expert is accepted and off: nothing to read ahead."""
    model, plan = load(folder, lookahead=2, offload_gb=0)
    assert not any(t.tier != Tier.DEVICE for t in plan.tensors)
    assert model.moe_offload_runtime.lookahead is None
    generate(model, prompt_ids(folder, 4), new_tokens=2)


def test_host_tier_experts_without_a_disk_tier_get_a_lookahead(folder):
    model, plan = load(folder, lookahead=1, offload_gb=0.0005)
    assert not any(t.tier == Tier.DISK for t in plan.tensors)
    rt = model.moe_offload_runtime
    assert rt.disk is None and rt.lookahead is not None
    generate(model, prompt_ids(folder, 4), new_tokens=3)
    assert rt.lookahead.predicted > 0 and rt.lookahead.hits + rt.lookahead.misses > 0


def test_unpicked_guesses_not_yet_read_are_cancelled(folder, plans):
    """A layer that routes drops its unpicked guesses: those still queued are never read (counted as cancelled,
    not wasted), and the disk delivers only the needed bytes. The worker is held busy for the whole call so that
    every guess is still queued when its layer routes."""
    ids = prompt_ids(folder, 8)
    model, _ = load(folder, plan=plans["late"], lookahead=1, disk_read="mmap")
    rt, la = model.moe_offload_runtime, model.moe_offload_runtime.lookahead
    recorded = routing(rt)
    want = generate(model, ids)
    reads = _disk_reads(recorded, range(1, LAYERS))
    la.reset()
    la.predictor = Replay(recorded, rt, E)      # right guesses only: the disk delivers the needed bytes, nothing more
    before = rt.disk.bytes_read
    generate(model, ids)
    exact = rt.disk.bytes_read - before
    assert la.wasted_bytes == la.cancelled_bytes == 0

    la.reset()
    la.predictor = Replay(recorded, rt, E, invert=True)
    import threading
    gate = threading.Event()
    held = la._pool.submit(gate.wait)       # the worker waits until the generation is over
    before = rt.disk.bytes_read
    try:
        got = generate(model, ids)
    finally:
        gate.set()
        held.result()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert (la.hits, la.misses) == (0, reads)
    assert la.predicted > 0 and la.wasted_bytes == 0 and la.cancelled_bytes == la.predicted * EXPERT
    assert rt.disk.bytes_read - before == exact
    stats = la.stats(NEW - 1)
    assert stats["lookahead_cancelled_bytes_per_token"] == la.predicted * EXPERT / (NEW - 1)


def test_a_lookahead_read_of_a_truncated_checkpoint_is_raised_where_the_row_is_needed(tmp_path):
    folder = tiny_model(tmp_path / "m")
    model, _ = load(folder, plan=_plan(folder, "late"), lookahead=1)
    la = model.moe_offload_runtime.lookahead

    class Every:   # every expert predicted: each disk read of a decode step is a look-ahead read
        def covers(self, layer):
            return layer > 0

        def predict(self, layer, hidden):
            return list(range(E))

    la.predictor = Every()
    ids = prompt_ids(folder, 8)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)                     # prefill: read on the critical path
        step = out.logits[:, -1:].argmax(-1)
        out = model(input_ids=step, cache=out.past_key_values, use_cache=True)   # a decode step reads fine
        assert la.hits > 0 and la.misses == 0
        shard = next(Path(folder).glob("*.safetensors"))
        os.truncate(shard, os.path.getsize(shard) // 2)
        with pytest.raises(CheckpointError, match="changed after it was opened|truncated") as err:
            model(input_ids=out.logits[:, -1:].argmax(-1), cache=out.past_key_values, use_cache=True)
    frames = {(Path(str(e.path)).name, e.name) for e in err.traceback}
    # where the row is needed (take), or, for a wrong guess still being read when the file was cut, where a
    # forward call settles its reads (settle): raised by a forward either way, never swallowed
    assert {("lookahead.py", "wait"), ("lookahead.py", "settle")} & frames, frames
    assert ("lookahead.py", "_read_all") in frames, frames          # the worker's read raised it


@pytest.mark.exact
@pytest.mark.parametrize("backend", BACKENDS)
def test_guesses_from_the_residual_after_attention_change_nothing_but_when(folder, plans, backend):
    """lookahead_from="attention": layer l + 1 guessed from layer l's residual before its MoE (a pre-hook on its
    post-attention norm), a whole expert step earlier; same tokens, logits and disk bytes, and guesses are used."""
    ids = prompt_ids(folder, 8)
    ref, _ = load(folder, plan=plans["budget"], backend=backend)
    want, calls0 = generate(ref, ids), list(ref.moe_offload_runtime.disk_counter.calls)
    model, _ = load(folder, plan=plans["budget"], backend=backend, lookahead=1, lookahead_from="attention")
    rt = model.moe_offload_runtime
    asked = []
    inner = rt.lookahead.predictor

    class Spy:   # which hidden state each guess is made from: the residual, before layer l's MoE adds to it
        def covers(self, layer):
            return inner.covers(layer)

        def predict(self, layer, hidden):
            asked.append((layer, hidden.clone()))
            return inner.predict(layer, hidden)

    rt.lookahead.predictor = Spy()
    got = generate(model, ids)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert list(rt.disk_counter.calls) == calls0
    assert rt.lookahead.source == "attention" and rt.lookahead.hits > 0
    assert asked and {layer for layer, _ in asked} <= set(range(1, LAYERS))
    # the pre-MoE residual differs from the layer's output (the MoE adds to it): the hook is not the output hook
    seen = []
    hook = model.model.layers[0].register_forward_hook(lambda m, a, out: seen.append(out[0] if isinstance(out, tuple)
                                                                                      else out))
    asked.clear()
    generate(model, ids, new_tokens=2)
    hook.remove()
    first = next(h for layer, h in asked if layer == 1)
    assert first.shape == seen[-1].shape and not torch.equal(first, seen[-1])


def test_an_unknown_guess_source_is_refused(folder, plans):
    with pytest.raises(MoeOffloadError, match="lookahead_from"):
        load(folder, plan=plans["all"], lookahead=1, lookahead_from="input")
