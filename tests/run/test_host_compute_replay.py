"""runtime == replay with host compute: a generation recorded as a trace, replayed under the same plan, caches and
expert-compute mode (routing/replay_compute.py), gives the runtime's counts: host-link bytes (weights, plus the
activations the runtime also counts there), activation bytes, disk bytes, and the pairs computed on the host."""

from __future__ import annotations

import pytest

from fixtures_models import load
from fixtures_placement import three_tier_plan
from moe_offload.formats.traces import TraceWriter, read_trace
from moe_offload.loading.loader import load_tokenizer
from moe_offload.measure.profile import record, trace_header
from moe_offload.planning.cost_model import ExpertCompute, Hardware
from moe_offload.planning.placement import GiB
from moe_offload.routing.replay_compute import compute_replay
from moe_offload.tiny.make import make_tiny

E, K = 6, 2
SPLIT = {"gate_up_proj": (1, 3, 4), "down_proj": (1, 3, 4)}
EXPERT = 18432
ANY = Hardware(host_bytes_per_s=50e9, host_flops_per_s=5e11, link_bytes_per_s=25e9)   # forced modes ignore it


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("hc-replay") / "qwen3_moe", family="qwen3_moe", layers=3, experts=E,
                     top_k=K, hidden=32)


@pytest.mark.parametrize("caches", [{}, dict(cache_gb=3 * EXPERT / GiB, host_cache_gb=2 * EXPERT / GiB,
                                             cache_policy="heat")], ids=["no cache", "both caches"])
@pytest.mark.parametrize("mode", ["host", "device"])
def test_runtime_equals_replay(folder, tmp_path, mode, caches):
    plan = three_tier_plan(folder, SPLIT)
    with load(folder, plan=plan, experts="fused", expert_compute=mode, **caches) as loaded:
        rt = loaded.runtime
        path = tmp_path / "trace.jsonl"
        with TraceWriter(path, trace_header(loaded.plan, "test")) as writer:
            record(loaded.model, load_tokenizer(folder), ["The storm reached the coast"], writer, max_new_tokens=10,
                   ignore_eos=True)
        got = dict(host_link=rt.counter.decode_bytes_per_token(),
                   activations=rt.activation_counter.decode_bytes_per_token(),
                   disk=rt.disk_counter.decode_bytes_per_token())
        on_host = rt.host_compute.experts_on_host if rt.host_compute is not None else 0
    r = compute_replay(loaded.plan, read_trace(path), ExpertCompute(mode), ANY, **caches)
    want = dict(host_link=r.counted_host_link_bytes_per_token + r.link_activation_bytes_per_token,
                activations=r.link_activation_bytes_per_token, disk=r.counted_disk_read_bytes_per_token)
    assert got == pytest.approx(want, rel=1e-12), f"runtime {got} != replay {want}"
    if mode == "host":
        assert got["activations"] > 0
    else:
        assert got["activations"] == 0 and on_host == 0
