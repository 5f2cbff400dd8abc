"""The runtime: measured link bytes equal a hand count from the routing that happened; honest mechanism
report on CPU; reused staging buffers; detach leaves no hook behind.

Hand count of one forward call (docs/design.md: a token pays the bytes of each offloaded tensor it reads):

    sum over MoE layers of  distinct experts the router selected (over every token of the call)
                            x bytes of one expert's slice of each offloaded routed-expert tensor of that layer
  + bytes of every offloaded dense language tensor (read in full)
  + distinct token ids of the call x bytes of one embedding row, when the input embedding is offloaded

The routing is recorded by forward hooks on the routers themselves (transformers' `*TopKRouter`
modules return `(logits, weights, top_k_index)`), independently of the runtime's experts function.
Models: `fixtures_models` (6 experts, top-2, 2 layers, float32).
"""

from __future__ import annotations

import re
from collections import defaultdict

import pytest
import torch

import moe_offload as mo
from fixtures_models import (load, ARMS, BACKENDS, EXPERTS, FAMILIES, SIZES, TIED_IDS, TIED_VOCAB, TOP_K, budgets,
                             make_tied, prompt_ids, reference_model, run, slice_bytes)
from moe_offload.planning.placement import GiB
from moe_offload.tiny.make import make_tiny

# Outputs compared bit for bit with the plain transformers model: `make test` reruns these under a second
# kernel path (see the Makefile).
pytestmark = pytest.mark.exact


# MoE layers per tiny model: DeepSeek-V3's first layer is dense (first_k_dense_replace=1).
# Layers with a router, read off each family's tiny 2-layer model: DeepSeek/GLM keep layer 0 dense
# (first_k_dense_replace=1); make_tiny's Jamba alternates a dense attention layer and a Mamba+MoE layer.
_FIRST_DENSE = {"deepseek_v3", "deepseek_v2", "glm4_moe", "jamba"}
MOE_LAYERS = {f: (1,) if f in _FIRST_DENSE else (0, 1) for f in FAMILIES}


class Routing:
    """Per forward call of the whole model: its input ids and, per router, the experts it selected."""

    def __init__(self, model):
        self.calls: list[dict] = []
        self.handles = [model.register_forward_pre_hook(self._start, with_kwargs=True)]
        self.routers = []
        for name, mod in model.named_modules():
            if type(mod).__name__.lower().endswith("topkrouter"):
                layer = int(re.search(r"\.layers\.(\d+)\.", name).group(1))
                self.routers.append(layer)
                self.handles.append(mod.register_forward_hook(self._hook(layer)))

    def _start(self, module, args, kwargs):
        self.calls.append({"ids": kwargs["input_ids"].clone(), "routed": []})

    def _hook(self, layer):
        def hook(module, args, output):
            top_k_index = output[-1]                    # [tokens, k] expert ids
            assert not top_k_index.is_floating_point() and top_k_index.shape[-1] == TOP_K
            self.calls[-1]["routed"].append((layer, top_k_index.clone()))
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


def hand_count(plan, routing: Routing, *, tied_rows: bool = False) -> list[tuple[int, int]]:
    """(tokens per sequence, bytes) per forward call, from the plan's byte sizes and the recorded routing."""
    slice_per_layer: dict[int, int] = defaultdict(int)
    # A tensor split between tiers (plan.host_experts) reads only its experts >= resident from the host.
    split_slices: dict[int, list[tuple[int, int]]] = defaultdict(list)   # layer -> [(first host expert, bytes)]
    dense = 0
    row = 0
    for t in plan.tensors:
        if t.tier != "host" or t.component != "language":  # a vision tower does not run on text
            continue
        if t.role == "routed_expert" and t.host_experts:
            split_slices[t.layer].append((t.shape[0] - t.host_experts, slice_bytes(t)))
        elif t.role == "routed_expert":
            slice_per_layer[t.layer] += slice_bytes(t)
        elif t.role == "embedding":
            row = t.bytes // t.shape[0]
        else:
            dense += t.bytes
            if tied_rows:  # the tied table is also read by rows, as the input embedding
                row = t.bytes // t.shape[0]
    out = []
    for call in routing.calls:
        nbytes = dense + row * call["ids"].unique().numel()
        for layer, index in call["routed"]:
            nbytes += slice_per_layer[layer] * index.unique().numel()
            for first_host, per_expert in split_slices[layer]:
                nbytes += per_expert * (index.unique() >= first_host).sum().item()
        out.append((call["ids"].shape[1], nbytes))
    return out


# --- measured bytes == hand count -----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arm", ARMS)
@pytest.mark.parametrize("family", FAMILIES)
def test_link_bytes_equal_hand_count(models, plans0, family, arm, backend):
    model, plan = load(models[family], backend=backend, **budgets(plans0(family))[arm])
    routing = Routing(model)
    assert sorted(routing.routers) == list(MOE_LAYERS[family])
    ids = prompt_ids(models[family])
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    calls = model.moe_offload_runtime.counter.calls
    # generate: one prefill call of the 12 prompt tokens, then one call per further new token.
    assert [n for n, _ in calls] == [12, 1, 1, 1, 1]
    assert calls == hand_count(plan, routing)

    if any(0 < t.host_experts < t.shape[0] for t in plan.tensors):   # split by expert (all: whole)
        # A split expert tensor reads only the picked experts that are on the host: the bytes of a step then
        # depend on the routing, which the hand count above follows; the uniform estimate is an expectation.
        assert decode_steps_vary_or_match(calls, plan)
        return
    # Decode steps by hand alone: one token picks exactly top_k distinct experts and reads one embedding row.
    per_layer = defaultdict(int)
    for t in plan.tensors:
        if t.tier == "host" and t.role == "routed_expert":
            per_layer[t.layer] += t.bytes // EXPERTS
    dense = sum(t.bytes for t in plan.tensors
                if t.tier == "host" and t.component == "language" and t.role not in ("routed_expert", "embedding"))
    row = sum(t.bytes // t.shape[0] for t in plan.tensors if t.tier == "host" and t.role == "embedding")
    decode = dense + row + TOP_K * sum(per_layer.values())
    assert [b for _, b in calls[1:]] == [decode] * 4
    assert model.moe_offload_runtime.counter.decode_bytes_per_token() == decode
    # At batch 1 the plan's uniform-routing estimate (k/E of each expert tensor, 1/vocab of the embedding) is
    # exact; offloaded vision-tower tensors are charged nothing, as text decoding never reads them.
    assert plan.link_bytes_per_token() == pytest.approx(decode, rel=1e-12)
    if arm == "resident":
        assert decode == 0 and calls[0][1] == 0
    else:
        assert decode > 0


def decode_steps_vary_or_match(calls, plan) -> bool:
    """Every decode step reads at least the dense/whole offloaded part and at most that plus all split slices."""
    whole = sum(t.offloaded_bytes for t in plan.tensors if t.component == "language" and not t.host_experts
                and t.role != "routed_expert" and t.role != "embedding")
    most = whole + sum(t.offloaded_bytes for t in plan.tensors if t.component == "language") + \
        sum(t.bytes // t.shape[0] for t in plan.tensors if t.role == "embedding" and t.tier == "host")
    return all(whole <= b <= most for _, b in calls[1:])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_batch_of_two_counts_distinct_experts_across_the_batch(models, plans0, family, backend):
    model, plan = load(models[family], backend=backend, **budgets(plans0(family))["sparse-first"])
    pad = model.config.pad_token_id
    long = prompt_ids(models[family], 12)[0]
    short = prompt_ids(models[family], 8)[0].flip(0)  # another sequence, 8 tokens
    ids = torch.stack([long, torch.cat([torch.full((4,), pad), short])])   # [2, 12], left padding
    mask = torch.stack([torch.ones(12, dtype=torch.long), torch.cat([torch.zeros(4), torch.ones(8)]).long()])
    routing = Routing(model)
    model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=pad)
    calls = model.moe_offload_runtime.counter.calls
    assert [n for n, _ in calls] == [12, 1, 1, 1, 1]
    assert calls == hand_count(plan, routing)
    # Each decode step routes 2 tokens: between k and 2k distinct experts per layer, and the union matters.
    distinct = [index.unique().numel() for call in routing.calls[1:] for _, index in call["routed"]]
    assert all(TOP_K <= d <= 2 * TOP_K for d in distinct)
    assert any(d > TOP_K for d in distinct), distinct
    decode = [b for _, b in calls[1:]]
    assert model.moe_offload_runtime.counter.decode_bytes_per_token(batch=2) == sum(decode) / (4 * 2)


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory):
    return make_tied(tmp_path_factory.mktemp("tied") / "qwen3_moe_tied")


@pytest.mark.parametrize("backend", BACKENDS)
def test_offloaded_tied_table_is_counted_as_head_and_rows(tied_model, backend):
    """The tied table is read in full by the LM head and by rows by the input embedding."""
    table = TIED_VOCAB * 32 * 4
    model, plan = load(tied_model, backend=backend, offload_gb=table / GiB, policy="declaration")
    assert [t.name for t in plan.tensors if t.tier == "host"] == ["model.embed_tokens.weight"]
    routing = Routing(model)
    ids = TIED_IDS
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    calls = model.moe_offload_runtime.counter.calls
    assert calls == hand_count(plan, routing, tied_rows=True)
    assert [b for _, b in calls[1:]] == [table + 32 * 4] * 3
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(run(model, ids, 4)[0], run(reference_model(tied_model, "qwen3_moe"), ids, 4)[0])


# --- mechanism ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_mechanism_is_reported_honestly_on_cpu(models, plans0, backend):
    model, _ = load(models["qwen3_moe"], backend=backend, **budgets(plans0("qwen3_moe"))["sparse-first"])
    runtime = model.moe_offload_runtime
    assert runtime.device.type == "cpu" and runtime.backend == backend
    text = runtime.mechanism.lower()
    assert backend in text and "cpu" in text and "no accelerator" in text
    assert "pinned" not in text and "no accelerator" in runtime.arena.mechanism.lower()
    assert all(not slab.registered and slab.view is None for slab in runtime.arena.slabs)


# --- staging buffers ------------------------------------------------------------------------------------------


def _staging(runtime) -> dict:
    bufs = {("staging", key): buf for key, buf in runtime._staging.items()}
    dense = getattr(runtime, "_dense", None)
    if dense is not None:
        bufs.update({("ring", i): buf for i, buf in enumerate(dense.ring) if buf is not None})
    return bufs


def _nbytes(bufs) -> int:
    return sum(b.numel() * b.element_size() for b in bufs.values())


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory):
    """qwen3_moe with 4 MoE layers: experts 4 x 110592 B = 442368 B."""
    return make_tiny(tmp_path_factory.mktemp("deep") / "qwen3_moe_4", family="qwen3_moe",
                     **{**SIZES, "layers": 4})


@pytest.mark.parametrize("arm", ["sparse-first", "all"])
def test_prefetch_staging_buffers_are_reused(deep_model, arm):
    model, plan = load(deep_model, backend="prefetch", **budgets(mo.plan(deep_model))[arm])
    runtime = model.moe_offload_runtime
    ids = prompt_ids(deep_model)
    routed_host = [t for t in plan.tensors if t.tier == "host" and t.role == "routed_expert"]
    assert len(routed_host) == 8  # every expert tensor of the 4 layers is offloaded
    run(model, ids, new_tokens=3)
    first = _staging(runtime)
    assert first, "the prefetch backend staged nothing"
    seen = {k: b.data_ptr() for k, b in first.items()}
    for _ in range(3):
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
        now = _staging(runtime)
        assert now.keys() == first.keys()                               # no new buffer per step or per layer
        assert {k: b.data_ptr() for k, b in now.items()} == seen        # the same memory, not reallocated
    # One buffer per expert-slice shape, never more than one layer's E experts (gate_up 96x32, down 32x48).
    # Row buffers are keyed ("rows", tensor name, row shape, dtype): one per expert tensor name, shared by layers.
    for key, buf in runtime._staging.items():
        if key[0] == "rows" and key[2] in ((96, 32), (32, 48)):
            assert buf.numel() <= EXPERTS * key[2][0] * key[2][1]
    expert_keys = {(key[1], key[2]) for key in runtime._staging if key[0] == "rows"}
    assert {("gate_up_proj", (96, 32)), ("down_proj", (32, 48))} <= expert_keys
    routed_bytes = sum(t.bytes for t in routed_host)
    assert _nbytes(first) < plan.offloaded_bytes
    assert _nbytes(first) <= routed_bytes / 4 + plan.offloaded_bytes - routed_bytes  # <= one layer of experts


# --- detach ---------------------------------------------------------------------------------------------------


def _hooks(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("backend", BACKENDS)
def test_detach_removes_every_hook(models, plans0, backend):
    family = "gpt_oss"
    model, plan = load(models[family], backend=backend, **budgets(plans0(family))["all"])
    runtime = model.moe_offload_runtime
    ids = prompt_ids(models[family])
    reference = run(reference_model(models[family], family), ids)
    run(model, ids)
    assert _hooks(model) > 0
    assert any(hasattr(m, "_moe_offload_state") for m in model.modules())
    runtime.detach()
    assert _hooks(model) == 0
    assert all(not m._forward_hooks_with_kwargs and not m._forward_pre_hooks_with_kwargs for m in model.modules())
    assert not any(hasattr(m, "_moe_offload_state") for m in model.modules())
    counted = list(runtime.counter.calls)
    got = run(model, ids)
    assert runtime.counter.calls == counted  # nothing counts any more
    assert all(torch.equal(a, b) for a, b in zip(got, reference))
    assert mo.audit(model, plan) == []


def test_one_token_prompt_prefill_is_not_a_decode_step(models):
    folder = models["qwen3_moe"]
    model, plan = load(folder, offload_gb=plan_total(folder) / GiB)  # everything offloaded
    ids = prompt_ids(folder, n=1)
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    counter = model.moe_offload_runtime.counter
    # Prefill of one token on an empty cache, then two decode steps.
    assert [n for n, _ in counter.calls] == [1, 1, 1]
    assert counter.decode == [False, True, True]
    prefill_bytes = counter.calls[0][1]
    decode = [b for _, b in counter.calls[1:]]
    assert counter.decode_bytes_per_token() == sum(decode) / 2
    assert prefill_bytes > 0


def plan_total(folder) -> int:
    return mo.plan(folder).total_bytes


def test_rows_of_two_tensors_staged_for_one_forward_do_not_share_a_buffer():
    """gpt-oss's gate_up_proj_bias [E, 2I] and down_proj_bias [E, H] have the same row shape when 2I == H:
    both are staged before the experts run, so each needs its own buffer."""
    import torch.nn as nn
    from moe_offload.run.runtime import Runtime
    from moe_offload.storage.host import HostArena

    rt = Runtime(nn.Module(), device=torch.device("cpu"), backend="prefetch",
                 arena=HostArena(torch.device("cpu"), False), host_names={})
    a, b = torch.arange(12.0).view(4, 3), -torch.arange(12.0).view(4, 3)
    rows = torch.tensor([1, 3])
    sa = rt.stage_rows(a, rows, key="gate_up_proj_bias")
    sb = rt.stage_rows(b, rows, key="down_proj_bias")
    assert torch.equal(sa, a[rows]) and torch.equal(sb, b[rows])
    assert sa.data_ptr() != sb.data_ptr()
    # The next layer reuses the same buffers.
    assert rt.stage_rows(a, rows, key="gate_up_proj_bias").data_ptr() == sa.data_ptr()


# --- the prefetch ring: stream ordering (with a stand-in for CUDA streams) and fresh copies --------------------


def _attention_offloaded(models, backend):
    folder = models["qwen3_moe"]
    p = mo.plan(folder)
    attn = sum(t.bytes for t in p.tensors if ".self_attn." in t.name)
    return mo.load(folder, device="cpu", backend=backend, offload_gb=attn / GiB, offload_params=["self_attn"])


class _FakeEvent:
    recorded = 0

    def record(self, stream=None):
        _FakeEvent.recorded += 1


class _FakeStream:
    def __init__(self, log):
        self.log = log

    def wait_event(self, event):
        assert event is not None, "waited on an event nobody recorded"
        self.log.append("wait")


def test_prefetch_ring_stream_ordering_with_two_layers(models, monkeypatch):
    """Two dense groups (the attention of layers 0 and 1): each call waits only on events that were recorded,
    and every forward after the first uses the side-stream prefetch."""
    import contextlib

    model, plan = _attention_offloaded(models, "prefetch")
    runtime = model.moe_offload_runtime
    log = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _FakeStream(log), raising=False)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent, raising=False)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext(), raising=False)
    runtime._stream = _FakeStream(log)
    ids = prompt_ids(models["qwen3_moe"])
    with torch.no_grad():
        ref = model(ids).logits
        for _ in range(3):
            assert torch.equal(model(ids).logits, ref)
    assert "wait" in log


def test_prefetch_sees_weight_updates(models):
    """A weight written in place between two calls is what the next call reads (no stale staged copy)."""
    ids = prompt_ids(models["qwen3_moe"])
    outs = {}
    for backend in BACKENDS:
        model, plan = _attention_offloaded(models, backend)
        name = "model.layers.0.self_attn.q_proj.weight"
        assert plan.tiers[name] == "host"
        with torch.no_grad():
            before = model(ids).logits
            mo.update_weights(model, {name: torch.zeros_like(model.get_parameter(name))})
            outs[backend] = model(ids).logits
        assert not torch.equal(outs[backend], before)
    assert torch.equal(outs["uva"], outs["prefetch"])


def test_prefetch_keeps_a_transform_that_changes_size(models):
    """A transform that changes a host tensor's size gets a new slab; prefetch then stages the new tensor."""
    model, plan = _attention_offloaded(models, "prefetch")
    name = "model.layers.0.self_attn.q_norm.weight"
    assert plan.tiers[name] == "host"  # attention's norms are under self_attn: selected and offloaded
    ids = prompt_ids(models["qwen3_moe"])
    with torch.no_grad():
        model(ids)  # the runtime has staged (and referenced) the old tensor once
    mo.transform_weights(model, lambda n, w: w.to(torch.float16).zero_(), names=[name])
    with torch.no_grad():
        model(ids)
    live = model.get_parameter(name)
    assert live.dtype == torch.float16 and not live.any()
    assert model.moe_offload_runtime.arena.owns(live)
