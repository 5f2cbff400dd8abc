"""Any subset of a fused routed-expert tensor's experts on the host (frequency placement's `host_expert_ids`):
a resident stack on the device, a host stack in a slab, an index map between them.

Plans are made here by hand (dataclasses.replace on a zero-budget plan), so the tests do not depend on the
planner that writes such plans. Models: fixtures_models (E=6 experts, top-2, 2 layers, float32): one expert's
slice is 12,288 B of gate_up_proj and 6,144 B of down_proj.

Hand count of one forward call: for each tensor split by expert, (distinct experts the call's router picked
in that layer that are in the tensor's host ids) x (bytes of one expert's slice); nothing else is offloaded.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import moe_offload as mo
import fixtures_models
from fixtures_models import BACKENDS, EXPERTS, FAMILIES, prompt_ids, reference_model, run
from moe_offload.errors import MoeOffloadError
from moe_offload.planning.placement import Plan

pytestmark = pytest.mark.exact

# Non-contiguous on purpose (not "the last n"), expert 0 included, a different subset per layer.
HOST_IDS = {0: (0, 3), 1: (1, 2, 5)}


@pytest.fixture(scope="module")
def references(models):
    """family -> (tokens, step logits, prefill logits) of the plain transformers model, computed once."""
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = run(reference_model(models[family], family), prompt_ids(models[family], 8), 4)
        return cache[family]

    return get


def subset_plan(folder, ids_of=lambda t: HOST_IDS[t.layer % 2]) -> Plan:
    """fixtures_models.subset_plan, by default with HOST_IDS of each layer on the host."""
    return fixtures_models.subset_plan(folder, ids_of)


def hand_count(plan: Plan, calls) -> list[int]:
    """Bytes per forward call from the plan's sizes and the recorded routing (layer -> top_k_index)."""
    split = [t for t in plan.tensors if t.host_expert_ids and len(t.host_expert_ids) < t.shape[0]]
    out = []
    for call in calls:
        nbytes = 0
        for t in split:
            picked = set(call.experts[t.layer].unique().tolist())
            nbytes += t.bytes // t.shape[0] * len(picked & set(t.host_expert_ids))
        out.append(nbytes)
    return out


def _load_recording(folder, plan, backend):
    model, plan = mo.load(folder, device="cpu", backend=backend, plan=plan)
    calls = []
    model.moe_offload_runtime.recorder = calls.append
    return model, plan, calls


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_any_subset_on_the_host_equals_transformers_and_counts_host_experts_only(models, references, family,
                                                                                 backend):
    folder = models[family]
    model, plan, calls = _load_recording(folder, subset_plan(folder), backend)
    runtime = model.moe_offload_runtime
    split = {t.name: t for t in plan.tensors if t.host_expert_ids}
    assert split and set(runtime.splits) == set(split)
    for name, t in split.items():
        layout = runtime.splits[name]
        assert layout.host_ids == HOST_IDS[t.layer % 2] and layout.num_experts == EXPERTS
        assert model.get_parameter(name).shape == (len(layout.host_ids), *t.shape[1:])   # the host stack
        assert layout.resident.shape == (EXPERTS - len(layout.host_ids), *t.shape[1:])
    assert runtime.arena.nbytes == plan.offloaded_bytes == sum(t.bytes // EXPERTS * t.host_experts
                                                               for t in split.values())
    assert mo.audit(model, plan) == []

    got = run(model, prompt_ids(folder, 8), 4)
    assert all(torch.equal(a, b) for a, b in zip(got, references(family)))

    measured = [b for _, b in runtime.counter.calls]
    assert len(calls) == len(measured) and measured == hand_count(plan, calls)
    # The subset matters: some call picked resident experts of a split tensor (read nothing for them) and
    # some call read host experts.
    everything = [sum(t.bytes // EXPERTS * call.experts[t.layer].unique().numel() for t in split.values())
                  for call in calls]
    assert any(m < e for m, e in zip(measured, everything)) and any(m > 0 for m in measured)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensors_of_one_module_may_split_differently(models, references, backend):
    """gpt-oss: weights and biases of a layer each with their own subset; a tensor wholly on the host by ids
    (all of its experts) is the whole tensor, not a split; one stays resident."""
    family = "gpt_oss"
    choice = {"gate_up_proj": (4,), "gate_up_proj_bias": (0, 1, 2, 3, 4, 5), "down_proj": (0, 2, 4),
              "down_proj_bias": None}
    folder = models[family]
    plan = subset_plan(folder, lambda t: choice[t.name.rpartition(".")[2]] if t.layer == 1 else (3,))
    model, plan, calls = _load_recording(folder, plan, backend)
    runtime = model.moe_offload_runtime
    whole = "model.layers.1.mlp.experts.gate_up_proj_bias"
    assert whole not in runtime.splits and model.get_parameter(whole).shape[0] == EXPERTS
    assert runtime.arena.owns(model.get_parameter(whole))
    assert not runtime.arena.owns(model.get_parameter("model.layers.1.mlp.experts.down_proj_bias"))
    assert runtime.splits["model.layers.1.mlp.experts.down_proj"].host_ids == (0, 2, 4)
    assert mo.audit(model, plan) == []
    got = run(model, prompt_ids(folder, 8), 4)
    assert all(torch.equal(a, b) for a, b in zip(got, references(family)))
    whole_t = next(t for t in plan.tensors if t.name == whole)
    expected = [n + whole_t.bytes // EXPERTS * call.experts[1].unique().numel()
                for n, call in zip(hand_count(plan, calls), calls)]
    assert [b for _, b in runtime.counter.calls] == expected


def test_legacy_last_n_plans_use_the_same_index_map(models):
    folder = models["mixtral"]
    plan = mo.plan(folder, offload_gb=0)
    tensors = tuple(dataclasses.replace(t, tier="host", host_experts=2) if t.role == "routed_expert" else t
                    for t in plan.tensors)
    model, _ = mo.load(folder, device="cpu", plan=dataclasses.replace(plan, tensors=tensors))
    layouts = model.moe_offload_runtime.splits.values()
    assert layouts and all(s.host_ids == (4, 5) and s.resident_ids == (0, 1, 2, 3) for s in layouts)
    split = next(iter(layouts))
    assert [split.where(e) for e in (0, 3, 4, 5)] == [("device", 0), ("device", 3), ("host", 0), ("host", 1)]


# --- weights reach both stacks ------------------------------------------------------------------------------


def test_update_and_transform_reach_both_stacks(models):
    family = "qwen3_moe"
    folder = models[family]
    model, plan = mo.load(folder, device="cpu", backend="prefetch", plan=subset_plan(folder))
    runtime = model.moe_offload_runtime
    name = "model.layers.1.mlp.experts.down_proj"          # host experts (1, 2, 5), resident (0, 3, 4)
    ids = prompt_ids(folder, 8)
    full = torch.randn(EXPERTS, 32, 48, generator=torch.Generator().manual_seed(1)) * 0.1
    mo.update_weights(model, {name: full})
    split = runtime.splits[name]
    assert torch.equal(split.resident, full[[0, 3, 4]]) and torch.equal(model.get_parameter(name), full[[1, 2, 5]])
    assert runtime.arena.owns(model.get_parameter(name)) and not runtime.arena.owns(split.resident)
    reference = reference_model(folder, family)
    with torch.no_grad():
        reference.get_parameter(name).copy_(full)
        want = reference(ids).logits
        assert torch.equal(model(ids).logits, want)

    transpose = lambda n, w: w.transpose(-1, -2).contiguous()   # noqa: E731 - expert by expert
    mo.transform_weights(model, transpose, names=[name])
    split = runtime.splits[name]
    assert split.resident.shape == (3, 48, 32) and model.get_parameter(name).shape == (3, 48, 32)
    assert torch.equal(split.resident, full[[0, 3, 4]].transpose(-1, -2))
    assert split.host_ids == (1, 2, 5) and runtime.arena.owns(model.get_parameter(name))
    mo.transform_weights(model, transpose, names=[name])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
    with pytest.raises(MoeOffloadError, match="shape"):
        mo.update_weights(model, {name: full[:5]})


def test_audit_checks_both_stacks(models):
    folder = models["qwen3_moe"]
    model, plan = mo.load(folder, device="cpu", plan=subset_plan(folder))
    runtime = model.moe_offload_runtime
    name = "model.layers.0.mlp.experts.gate_up_proj"       # host experts (0, 3), resident (1, 2, 4, 5)
    split = runtime.splits[name]
    runtime.splits[name] = dataclasses.replace(split, resident=runtime.host_tensors[name].clone()[:1])
    (mismatch,) = mo.audit(model, plan)
    assert mismatch.name == f"{name}[[1, 2, 4, 5]]" and "shape [1, 96, 32]" in mismatch.actual
    assert mismatch.bytes == 4 * 12288
    # A resident stack in host memory is not resident.
    in_slab, _ = runtime.arena.allocate("test", [(name, tuple(split.resident.shape), split.resident.dtype)])[name]
    runtime.splits[name] = dataclasses.replace(split, resident=in_slab)
    (mismatch,) = mo.audit(model, plan)
    assert (mismatch.name, mismatch.planned, mismatch.actual) == (f"{name}[[1, 2, 4, 5]]", "device", "host")
    runtime.splits[name] = split
    assert mo.audit(model, plan) == []
    with torch.no_grad():
        model.get_submodule("model.layers.0.mlp.experts")._parameters["gate_up_proj"] = \
            torch.nn.Parameter(model.get_parameter(name).clone(), requires_grad=False)   # host stack copied off
    (mismatch,) = mo.audit(model, plan)
    assert (mismatch.name, mismatch.planned, mismatch.actual) == (name, "host", "device")
    assert mismatch.bytes == 2 * 12288


# --- plans refused --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ids, count, match", [
    ((0, 6), 2, "out of range"),
    ((-1, 2), 2, "out of range"),
    ((3, 1), 2, "not sorted"),
    ((2, 2), 2, "more than once"),
    ((1, 4), 3, "host_experts says 3"),
])
def test_bad_host_expert_ids_are_refused(models, ids, count, match):
    folder = models["qwen3_moe"]
    plan = mo.plan(folder, offload_gb=0)
    name = "model.layers.0.mlp.experts.down_proj"
    tensors = tuple(dataclasses.replace(t, tier="host", host_experts=count, host_expert_ids=ids)
                    if t.name == name else t for t in plan.tensors)
    with pytest.raises(MoeOffloadError, match=match) as err:
        mo.load(folder, device="cpu", plan=dataclasses.replace(plan, tensors=tensors))
    assert name in str(err.value) and "plan this model again" in str(err.value)


@pytest.mark.parametrize("role, tier", [("embedding", "host"), ("routed_expert", "device")])
def test_host_expert_ids_only_on_an_expert_tensor_on_the_host(models, role, tier):
    folder = models["qwen3_moe"]
    plan = mo.plan(folder, offload_gb=0)
    first = next(t.name for t in plan.tensors if t.role == role)
    tensors = tuple(dataclasses.replace(t, tier=tier, host_experts=2, host_expert_ids=(0, 3))
                    if t.name == first else t for t in plan.tensors)
    with pytest.raises(MoeOffloadError, match="only a fused routed-expert tensor on the host can go in part"):
        mo.load(folder, device="cpu", plan=dataclasses.replace(plan, tensors=tensors))


def test_wrap_modules_refuses_a_subset_but_takes_all_experts_by_id(models):
    folder = models["qwen3_moe"]
    with pytest.raises(MoeOffloadError, match="in part"):
        mo.Offloader(plan=subset_plan(folder))
    everything = subset_plan(folder, lambda t: tuple(range(EXPERTS)))
    assert mo.Offloader(plan=everything).plan_tiers == everything.tiers
