"""Host compute (run/host_compute.py): offloaded experts computed by the CPU kernels where they lie, the device's own
meanwhile, their pair outputs summed in slot order. On a CPU-only machine the device and the host are one memory, so
everything but the link's speed is checked here: the logits equal the resident model's under the same kernels, bit
for bit; only activations are charged to the link; a forced `device` is the runtime as before; the per-step choice
follows the cost model; the worker leaves nothing behind."""

from __future__ import annotations

import threading

import pytest
import torch

import moe_offload as mo
from fixtures_models import BACKENDS, load, prompt_ids
from fixtures_placement import recorded_plans, three_tier_plan
from moe_offload.planning.cost_model import ExpertCompute, Hardware
from moe_offload.planning.placement import GiB
from moe_offload.run.host_compute import HostCompute
from moe_offload.run.read_plan import Source
from moe_offload.tiny.make import make_tiny

E, K, LAYERS = 6, 2, 3
SPLIT = {"gate_up_proj": (1, 3, 4), "down_proj": (1, 3, 4)}
NEW = 6
WORKER = "moe-offload-host-experts"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("host-compute") / "qwen3_moe", family="qwen3_moe", layers=LAYERS,
                     experts=E, top_k=K, hidden=32)


def _plan(folder, layout: str):
    """whole: every routed expert on the host tier; split: layer 0 split device/host, layer 1 on the host, layer 2
    split device/disk (its disk rows land in host memory and are computed there)."""
    return three_tier_plan(folder, SPLIT, layout)


def _generate(model, ids):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                             eos_token_id=[], pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.cat(out.logits)


@pytest.fixture(scope="module")
def resident(folder):
    model, _ = load(folder, offload_gb=0, experts="fused")
    return _generate(model, prompt_ids(folder, 8))


@pytest.mark.exact
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["whole", "split"])
def test_logits_equal_the_resident_model_under_the_same_kernels(folder, resident, layout, backend):
    with load(folder, plan=_plan(folder, layout), backend=backend, experts="fused", expert_compute="host") as loaded:
        got = _generate(loaded.model, prompt_ids(folder, 8))
        hc = loaded.runtime.host_compute
        assert hc.steps[ExpertCompute.HOST] > 0 and hc.experts_on_host > 0
    assert torch.equal(got[0], resident[0]) and torch.equal(got[1], resident[1])


@pytest.mark.exact
@pytest.mark.parametrize("quant", [None, "mxfp4"])
def test_gpt_oss_biases_and_mxfp4_experts_computed_on_the_host(tmp_path, quant):
    """gpt-oss: per-expert biases beside the weights (offloaded with them) and, as released, MXFP4 experts read as
    stored by the host's kernels; every expert on the host, the logits equal the resident model's."""
    folder = make_tiny(tmp_path / "gpt_oss", family="gpt_oss", layers=2, experts=4, top_k=2, hidden=64,
                       **({"quant": quant} if quant else {}))
    ids = prompt_ids(folder, 6)
    with load(folder, offload_gb=0, experts="fused") as loaded:
        want = _generate(loaded.model, ids)
    experts = mo.plan(folder, offload_gb=0).roles()["routed_expert"]["bytes"]
    with load(folder, offload_gb=experts / GiB, offload_params="experts", experts="fused",
              expert_compute="host") as loaded:
        got = _generate(loaded.model, ids)
        assert loaded.runtime.host_compute.experts_on_host > 0
        assert loaded.runtime.counter.decode_bytes_per_token() == \
            loaded.runtime.activation_counter.decode_bytes_per_token()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.exact
def test_with_the_eager_loop_on_the_device_side_the_tokens_are_the_residents(folder, resident):
    """experts="eager": the device's pairs go through one product per expert; the sums are in slot order, not the
    eager loop's expert order, so the logits agree within rounding, the greedy tokens exactly here."""
    with load(folder, plan=_plan(folder, "split"), experts="eager", expert_compute="host") as loaded:
        tokens, logits = _generate(loaded.model, prompt_ids(folder, 8))
    assert torch.equal(tokens, resident[0])
    assert torch.allclose(logits, resident[1], atol=1e-3, rtol=1e-3)


def test_only_activations_cross_the_link_for_experts_the_host_computes(folder):
    with load(folder, plan=_plan(folder, "whole"), experts="fused", expert_compute="host") as loaded:
        rt = loaded.runtime
        _generate(loaded.model, prompt_ids(folder, 8))
        hidden = loaded.model.config.hidden_size * loaded.model.dtype.itemsize
        # per decoded token and layer: the token's hidden state in, one output per (token, expert) pair back
        per_token = LAYERS * (1 + K) * hidden
        assert rt.activation_counter.decode_bytes_per_token() == per_token
        assert rt.counter.decode_bytes_per_token() == per_token          # the link carried nothing else
        assert rt.disk_counter.decode_bytes_per_token() == 0


def test_a_forced_device_is_the_runtime_as_before(folder):
    counts = []
    for mode in ("device", None):
        with load(folder, plan=_plan(folder, "split"), experts="fused", expert_compute=mode or "device") as loaded:
            if mode is None:
                assert loaded.runtime.host_compute is None
            got = _generate(loaded.model, prompt_ids(folder, 8))
            rt = loaded.runtime
            counts.append((got[0].tolist(), rt.counter.calls, rt.disk_counter.calls,
                           rt.activation_counter.decode_bytes_per_token()))
    assert counts[0] == counts[1] and counts[0][3] == 0


def test_auto_on_a_cpu_only_machine_reads_in_place_as_before(folder):
    with load(folder, plan=_plan(folder, "whole"), experts="fused") as loaded:
        assert loaded.runtime.host_compute is None       # the device is the host: nothing to choose


def test_auto_follows_the_cost_model_per_step(folder, resident):
    """A machine where a decode step's experts are cheaper on the host and a prefill's on the device (the host's FLOP
    rate between half and four thirds of the link's byte rate, for this model's fp32 experts: see the cost model):
    the prefill streams, every decode step computes on the host, and the tokens do not change."""
    with load(folder, plan=_plan(folder, "whole"), experts="fused", expert_compute="host") as loaded:
        rt = loaded.runtime
        rt.host_compute.close()
        rt.host_compute = HostCompute(ExpertCompute.AUTO, Hardware(host_bytes_per_s=1e12, host_flops_per_s=1e9,
                                                                   link_bytes_per_s=1e9))
        with recorded_plans() as plans:
            got = _generate(loaded.model, prompt_ids(folder, 8))
        sides = [(len(p.selected.slots) == K, p.host is not None) for p in plans]   # (a decode step, on the host)
    assert sides[:LAYERS] == [(False, False)] * LAYERS             # the prefill: on the device
    assert sides[LAYERS:] == [(True, True)] * (LAYERS * (NEW - 1))  # each decode step: on the host
    assert torch.equal(got[0], resident[0])


def test_the_plan_names_host_compute_as_a_source(folder):
    with load(folder, plan=_plan(folder, "split"), experts="fused", expert_compute="host") as loaded:
        with recorded_plans() as plans:
            _generate(loaded.model, prompt_ids(folder, 8))
    for plan in plans:
        for t in plan.tensors:
            for r in t.reads:
                if r.expert in plan.on_host:
                    assert r.source is (Source.DISK if t.on_disk else Source.HOST_COMPUTE) and (
                        r.counter is None) == (not t.on_disk)
                else:
                    assert r.source is not Source.HOST_COMPUTE
    assert any(p.on_host and len(p.on_host) < len(p.selected.ids) for p in plans)   # both sides in one step


def test_a_device_cache_keeps_its_hits_and_admissions_on_the_device(folder):
    with load(folder, plan=_plan(folder, "whole"), experts="fused", expert_compute="host", cache_gb=12 * 18432 / GiB,
              cache_policy="lru") as loaded:
        with recorded_plans() as plans:
            _generate(loaded.model, prompt_ids(folder, 8))
        assert loaded.runtime.cache.policy.hits > 0
    for plan in plans:
        assert not set(plan.on_host) & set(plan.device_hits)
        for t in plan.tensors:
            assert not {p for p, _ in t.admit_device} & {r.position for r in t.reads if r.expert in plan.on_host}


def test_closing_stops_the_worker(folder):
    before = {t.name for t in threading.enumerate()}
    with load(folder, plan=_plan(folder, "split"), experts="fused", expert_compute="host") as loaded:
        _generate(loaded.model, prompt_ids(folder, 8))
        assert any(t.name.startswith(WORKER) for t in threading.enumerate())   # steps with pairs on both sides
    assert {t.name for t in threading.enumerate()} == before


@pytest.mark.parametrize("kw,match", [(dict(expert_compute="gpu"), "expert_compute='gpu': use auto or host or device"),
                                      (dict(link_gbps=0), "link_gbps=0 is not a rate"),
                                      (dict(host_gflops=-3.0), "host_gflops=-3.0 is not a rate")])
def test_bad_options_are_refused_before_anything_loads(folder, kw, match):
    with pytest.raises(mo.MoeOffloadError, match=match):
        load(folder, plan=_plan(folder, "whole"), **kw)
