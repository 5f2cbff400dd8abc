"""The read plan of a layer step (run/read_plan.py) and its executor (run/read_executor.py), on a model where every
source occurs: three layers, the first split between the device and the host tier, the second whole on the host
tier, the third split between the device and the disk tier; a device cache and a host cache of two experts each and a
look-ahead that predicts every expert. Every plan of a generation is recorded and checked against the placement; the
counters equal the plans' charges; the tokens equal the resident model's."""

from __future__ import annotations

import pytest
import torch

from fixtures_models import load, prompt_ids
from fixtures_placement import recorded_plans, three_tier_plan
from moe_offload.planning.placement import GiB
from moe_offload.run.read_plan import Counter, Source
from moe_offload.run.runtime import runtime_of
from moe_offload.tiny.make import make_tiny

E, K = 6, 2
SPLIT = {"gate_up_proj": (1, 3, 4), "down_proj": (1, 4)}   # the offloaded experts of layers 0 and 2
EXPERT = 18432                                             # one expert's bytes over both routed tensors
NEW = 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("read-plan") / "qwen3_moe", family="qwen3_moe", layers=3, experts=E,
                     top_k=K, hidden=32)


class Every:
    """Predicts every expert of layers 1 and 2: every off-device read of a decode step there is started ahead."""

    def covers(self, layer):
        return layer > 0

    def predict(self, layer, hidden):
        return list(range(E))


def _generate(model, ids):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                              eos_token_id=[], pad_token_id=0)


@pytest.fixture(scope="module")
def recorded(folder):
    """(the plans of one generation, the runtime, the tokens, the resident model's tokens)."""
    ids = prompt_ids(folder, 8)
    resident, _ = load(folder, offload_gb=0)
    want = _generate(resident, ids)
    size = 2 * EXPERT / GiB
    model, _ = load(folder, plan=three_tier_plan(folder, SPLIT), backend="prefetch", cache_gb=size, host_cache_gb=size,
                    cache_policy="lru", lookahead=1)
    rt = runtime_of(model)
    rt.lookahead.predictor = Every()
    with recorded_plans() as plans:
        got = _generate(model, ids)
    return plans, rt, got, want


def test_the_tokens_equal_the_resident_models(recorded):
    _, _, got, want = recorded
    assert torch.equal(got, want)


def test_every_selected_expert_of_every_tensor_is_read_once_in_ascending_order(recorded):
    plans, _, _, _ = recorded
    assert len(plans) == 3 * NEW      # a prefill and NEW - 1 decode steps, three layers each
    for plan in plans:
        ids = list(plan.selected.ids)
        assert ids == sorted(set(ids))
        assert {t.name for t in plan.tensors} == {"gate_up_proj", "down_proj"}
        for t in plan.tensors:
            assert [r.position for r in t.reads] == list(range(len(ids)))
            assert [r.expert for r in t.reads] == ids


def test_each_read_comes_from_where_the_placement_and_the_caches_put_it(recorded):
    plans, _, _, _ = recorded
    for plan in plans:
        for t in plan.tensors:
            offloaded = set(range(E)) if plan.layer == 1 else set(SPLIT[t.name])
            assert t.on_disk == (plan.layer == 2)
            for r in t.reads:
                if r.expert not in offloaded:
                    assert r.source is Source.RESIDENT and r.counter is None
                elif r.expert in plan.device_hits:
                    assert r.source is Source.DEVICE_PAGE and r.counter is None and r.pages
                elif r.expert in plan.host_hits:
                    assert t.on_disk and r.source is Source.HOST_PAGE and r.counter is Counter.LINK and r.pages
                else:
                    assert r.source in ((Source.AHEAD, Source.DISK) if t.on_disk else (Source.AHEAD, Source.HOST_ROW))
                    assert r.counter is (Counter.DISK if t.on_disk else Counter.LINK)
            for position, pages in t.admit_device + t.admit_host:
                assert t.reads[position].source not in (Source.RESIDENT, Source.DEVICE_PAGE) and pages
        assert set(plan.below()) == {r.expert for t in plan.tensors for r in t.reads
                                     if r.source in (Source.HOST_ROW, Source.AHEAD, Source.DISK)}


def test_every_source_occurs(recorded):
    """The model was built so that each source serves some read: this test would not see a source that vanished."""
    plans, _, _, _ = recorded
    seen = {r.source for plan in plans for t in plan.tensors for r in t.reads}
    assert seen == set(Source) - {Source.HOST_COMPUTE}   # no host compute here: test_host_compute.py has it
    prefill = plans[:3]    # no cache, no look-ahead on a prefill: the link and the disk
    assert {r.source for plan in prefill for t in plan.tensors for r in t.reads} == \
        {Source.RESIDENT, Source.HOST_ROW, Source.DISK}


def test_the_counters_are_the_plans_charges(recorded):
    """Nothing but the experts is offloaded: the link and disk counters over the whole generation are the sum of
    the plans' charges (TokenBytes.step_bytes of each plan's selection, device hits and host hits)."""
    plans, rt, _, _ = recorded
    host = disk = 0
    for plan in plans:
        h, d = rt.token_bytes.step_bytes(plan.layer, plan.selected.ids, plan.device_hits, plan.host_hits)
        host, disk = host + h, disk + d
    assert sum(b for _, b in rt.counter.calls) == host > 0
    assert sum(b for _, b in rt.disk_counter.calls) == disk > 0
