"""Quantized routed experts on the disk tier (disk_tier.py `_stored`): FP8 and MXFP4 experts are read from the
checkpoint as stored, their values and their scales, and never dequantized into memory.

- every routed tensor on disk, or split (experts 1 and 4 on disk, the rest resident): the generation equals the
  same model resident, bit for bit: by the CPU kernels (each decode step streamed: experts computed as their rows
  land; alone, with the host cache, with a look-ahead) and by the eager loop (the read rows dequantized);
- the model holds meta placeholders of the stored shapes for the values and the scales; the audit passes;
- the disk counter equals replay's accounting of the generation's own trace (the stored bytes, scales included),
  and a decode step asks the readers for exactly the selected experts' values and scales;
- a quantized dense Linear weight on disk is refused, with the way out.

Models: make_tiny (fixtures_experts.SIZES: 2 layers, hidden 64, 8 experts), gpt-oss MXFP4, Qwen3-MoE and
DeepSeek-V3 FP8 (per-expert checkpoint tensors, 128x128 block scales).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import moe_offload as mo
from fixtures_experts import SIZES, generate_new
from fixtures_models import load, prompt_ids, replay_own_trace
from moe_offload.errors import MoeOffloadError
from moe_offload.planning.placement import Tier
from moe_offload.run import experts as experts_py
from moe_offload.run.runtime import runtime_of
from moe_offload.tiny.make import make_tiny

pytestmark = pytest.mark.exact

QUANT = {"gpt_oss": "mxfp4", "qwen3_moe": "fp8", "deepseek_v3": "fp8"}
WAYS = {"disk": {}, "host cache": {"host_cache_gb": 0.0001}, "look-ahead": {"lookahead": 1}}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("disk-quant")
    return {f: make_tiny(root / f, family=f, quant=q, **SIZES) for f, q in QUANT.items()}


@pytest.fixture(scope="module")
def resident(folders):
    """(family, experts mode) -> (prompt ids, the generation with nothing offloaded)."""
    done = {}

    def get(family, experts):
        if (family, experts) not in done:
            ids = prompt_ids(folders[family], 10)
            model, _ = load(folders[family], offload_gb=0, experts=experts)
            done[family, experts] = ids, generate_new(model, ids)
        return done[family, experts]

    return get


@pytest.fixture
def streamed_steps(monkeypatch):
    taken = []
    real = experts_py.streamed_step
    monkeypatch.setattr(experts_py, "streamed_step", lambda *a, **k: taken.append(1) or real(*a, **k))
    return taken


def on_disk(path, split: bool = False):
    """A zero-budget plan with every routed-expert tensor on the disk tier (`split`: only experts 1 and 4)."""
    p0 = mo.plan(path, offload_gb=0)
    more = dict(host_experts=2, host_expert_ids=(1, 4)) if split else {}
    return dataclasses.replace(p0, tensors=tuple(dataclasses.replace(t, tier=Tier.DISK.value, **more)
                                                 if t.role == "routed_expert" else t for t in p0.tensors))


def _same(got, want):
    (seq, logits), (want_seq, want_logits) = got, want
    assert torch.equal(seq, want_seq)
    assert torch.equal(logits, want_logits), f"max |diff| {(logits.float() - want_logits.float()).abs().max()}"


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("family", QUANT)
def test_quantized_experts_on_disk_stream_bitwise_the_resident(folders, resident, streamed_steps, family, way):
    path = folders[family]
    ids, want = resident(family, "fused")
    with load(path, plan=on_disk(path), experts="fused", **WAYS[way]) as loaded:
        model, plan = loaded.model, loaded.plan
        rt = runtime_of(model)
        assert mo.audit(model, plan) == []
        quantized = [n for n, t in rt.disk.tensors.items() if n in rt.quant]
        assert quantized, "no quantized tensor on the disk tier"
        tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        for name in quantized:      # values and scales: placeholders of the stored shapes, no memory
            q = rt.quant[name]
            assert tensors[name].device.type == "meta" and tuple(tensors[name].shape) == q.data_shape
            assert tensors[q.scale_name].device.type == "meta" and tuple(tensors[q.scale_name].shape) == q.scale_shape
            assert q.scale_name in rt.disk.tensors
        got = generate_new(model, ids)
        if way == "host cache":
            stats = rt.host_cache.stats()
            assert stats["host_cache_hits"] > 0 and stats["host_cache_misses"] > 0, stats
    _same(got, want)
    moe_layers = len({t.layer for t in plan.tensors if t.role == "routed_expert"})
    assert len(streamed_steps) == (got[0].shape[1] - ids.shape[1] - 1) * moe_layers


@pytest.mark.parametrize("experts", ["fused", "eager"])
@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_quantized_experts_split_between_resident_and_disk(folders, resident, family, experts):
    path = folders[family]
    ids, want = resident(family, experts)
    with load(path, plan=on_disk(path, split=True), experts=experts) as loaded:
        rt = runtime_of(loaded.model)
        assert mo.audit(loaded.model, loaded.plan) == []
        for name, q in rt.quant.items():    # the values' and the scales' resident stacks hold the same experts
            if name in rt.disk.tensors:
                assert rt.splits[name].host_ids == rt.splits[q.scale_name].host_ids == (1, 4)
        got = generate_new(loaded.model, ids)
    _same(got, want)


@pytest.mark.parametrize("family", QUANT)
def test_disk_bytes_are_the_stored_bytes_and_equal_replay(folders, family, tmp_path):
    path = folders[family]
    model, plan = load(path, plan=on_disk(path), experts="fused")
    rt = runtime_of(model)
    rt.disk_counter.reset()
    result = replay_own_trace(model, plan, path, tmp_path / "trace.jsonl", tokens=4)
    assert result.disk_read_bytes_per_token == pytest.approx(rt.disk_counter.decode_bytes_per_token(), rel=1e-12)
    # one decode step: the readers deliver exactly the selected experts' values and scales
    ids = prompt_ids(path)
    routed = []
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        rt.recorder = routed.append
        payload = []
        for src in rt.disk.tensors.values():
            real = src.read_rows

            def spy(rows, out_, pool=None, real=real, src=src):
                payload.append(len(list(rows)) * src.row_bytes)
                return real(rows, out_, pool)

            object.__setattr__(src, "read_rows", spy)
        model(input_ids=out.logits[:, -1:].argmax(-1), cache=out.past_key_values, use_cache=True)
    (call,) = routed
    assert call.decode
    selected = {layer: sorted(set(top.reshape(-1).tolist())) for layer, top in call.experts.items()}
    per_expert = {}
    for t in plan.tensors:
        if t.tier == Tier.DISK and t.role == "routed_expert":
            per_expert[t.layer] = per_expert.get(t.layer, 0) + t.bytes // t.shape[0]
    assert sum(payload) == sum(len(e) * per_expert[layer] for layer, e in selected.items())


def test_a_quantized_dense_weight_on_disk_is_refused(folders):
    path = folders["qwen3_moe"]
    p0 = mo.plan(path, offload_gb=0)
    fp8 = [t for t in p0.tensors if t.dtype == "float8_e4m3fn" and t.role != "routed_expert"]
    assert fp8, "the FP8 model has no quantized dense weight"
    plan = dataclasses.replace(p0, tensors=tuple(dataclasses.replace(t, tier=Tier.DISK.value) if t in fp8 else t
                                                 for t in p0.tensors))
    with pytest.raises(MoeOffloadError, match="quantized Linear weight.*--host-memory"):
        load(path, plan=plan)
