"""Routed-expert tensors offloaded in part: the last experts of one fused tensor on the host, the first on the
device, so the budget's overshoot is below one expert slice."""

import dataclasses
import json

import pytest
import torch

import moe_offload as mo
from fixtures_models import EXPERTS, prompt_ids, reference_model, run
from moe_offload.errors import MoeOffloadError
from moe_offload.planning.placement import GiB, Plan

# Outputs compared bit for bit with the plain transformers model: `make test` reruns these under a second
# kernel path (see the Makefile).
pytestmark = pytest.mark.exact

FAMILY = "deepseek_v3"          # layer 0 dense, layer 1 MoE: one gate_up_proj [6, 96, 32] and down_proj [6, 32, 48]
GATE_UP = "model.layers.1.mlp.experts.gate_up_proj"
DOWN = "model.layers.1.mlp.experts.down_proj"
SLICE_DOWN = 32 * 48 * 4        # 6,144 B per expert of down_proj (gate_up_proj's: 12,288 B)


@pytest.fixture
def folder(models):
    return models[FAMILY]


def _split_budget(plans0) -> int:
    embed = next(t for t in plans0(FAMILY).tensors if t.role == "embedding").bytes
    return embed + 2 * SLICE_DOWN + 1   # the embedding, then 2 experts and a byte: 3 of down_proj's 6 experts


def test_plan_splits_the_tensor_with_the_smallest_expert_slice(folder, plans0):
    budget = _split_budget(plans0)
    plan = mo.plan(folder, offload_gb=budget / GiB)
    assert {t.name: t.host_experts for t in plan.tensors if t.host_experts} == {DOWN: 3}
    down = next(t for t in plan.tensors if t.name == DOWN)
    assert down.tier == "host" and down.resident_experts == EXPERTS - 3
    assert down.offloaded_bytes == 3 * SLICE_DOWN
    over = plan.offloaded_bytes - budget
    assert 0 <= over < SLICE_DOWN                                   # below one expert slice
    assert any("went in part (its last 3 of 6 experts" in n for n in plan.notes)
    assert Plan.from_json(plan.to_json()) == plan
    saved = {t["name"]: t["host_experts"] for t in json.loads(plan.to_json())["tensors"]}
    assert saved[DOWN] == 3 and saved[GATE_UP] == 0


@pytest.mark.parametrize("backend", ["uva", "prefetch"])
def test_split_model_equals_transformers_and_sits_where_planned(folder, plans0, backend):
    model, plan = mo.load(folder, device="cpu", backend=backend, offload_gb=_split_budget(plans0) / GiB)
    runtime = model.moe_offload_runtime
    assert {t.name: t.host_experts for t in plan.tensors if t.host_experts} == {DOWN: 3}
    split = runtime.splits[DOWN]
    part = split.resident
    assert split.host_ids == (3, 4, 5) and split.resident_ids == (0, 1, 2)
    assert part.shape == (3, 32, 48) and not runtime.arena.owns(part)
    assert model.get_parameter(DOWN).shape == (3, 32, 48) and runtime.arena.owns(model.get_parameter(DOWN))
    assert runtime.arena.nbytes == plan.offloaded_bytes          # host memory: exactly the offloaded experts
    assert mo.audit(model, plan) == []
    ids = prompt_ids(folder)
    ref_tokens, ref_steps, ref_prefill = run(reference_model(folder, FAMILY), ids)
    tokens, steps, prefill = run(model, ids)
    assert torch.equal(tokens, ref_tokens) and torch.equal(steps, ref_steps) and torch.equal(prefill, ref_prefill)


def test_audit_reports_a_missing_or_wrong_device_part(folder, plans0):
    model, plan = mo.load(folder, device="cpu", offload_gb=_split_budget(plans0) / GiB)
    runtime = model.moe_offload_runtime
    split = runtime.splits[DOWN]
    runtime.splits[DOWN] = dataclasses.replace(split, host_ids=(2, 3, 4, 5))   # an index map the plan did not make
    assert [(m.name, m.planned) for m in mo.audit(model, plan)] == [(f"{DOWN}[:3]", "device")]
    del runtime.splits[DOWN]
    (mismatch,) = mo.audit(model, plan)
    assert mismatch.actual == "missing" and mismatch.bytes == 3 * SLICE_DOWN


def test_transforms_and_updates_reach_both_parts(folder, plans0):
    model, plan = mo.load(folder, device="cpu", backend="prefetch", offload_gb=_split_budget(plans0) / GiB)
    ids = prompt_ids(folder)
    with torch.no_grad():
        before = model(ids).logits
    transpose = lambda name, w: w.transpose(-1, -2).contiguous()   # noqa: E731 - expert by expert
    mo.transform_weights(model, transpose, names=[DOWN])
    part = model.moe_offload_runtime.splits[DOWN].resident
    assert part.shape == (3, 48, 32) and model.get_parameter(DOWN).shape == (3, 48, 32)
    mo.transform_weights(model, transpose, names=[DOWN])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    full = torch.arange(EXPERTS * 32 * 48, dtype=torch.float32).view(EXPERTS, 32, 48)
    mo.update_weights(model, {DOWN: full})
    part = model.moe_offload_runtime.splits[DOWN].resident
    assert torch.equal(part, full[:3]) and torch.equal(model.get_parameter(DOWN), full[3:])
    with pytest.raises(MoeOffloadError, match="shape"):
        mo.update_weights(model, {DOWN: full[:5]})


def test_wrap_modules_refuses_a_split_plan(folder, plans0):
    plan = mo.plan(folder, offload_gb=_split_budget(plans0) / GiB)
    with pytest.raises(MoeOffloadError, match="in part"):
        mo.Offloader(plan=plan)


@pytest.mark.parametrize("bad", [-1, EXPERTS + 3])   # EXPERTS: all experts, the whole tensor (test_subset.py)
def test_plans_with_an_impossible_split_are_refused(folder, bad):
    plan = mo.plan(folder, offload_gb=0)
    tensors = tuple(dataclasses.replace(t, tier="host", host_experts=bad) if t.name == DOWN else t
                    for t in plan.tensors)
    with pytest.raises(MoeOffloadError, match="can go in part"):
        mo.load(folder, plan=dataclasses.replace(plan, tensors=tensors))


def test_a_split_of_a_tensor_that_is_not_a_routed_expert_is_refused(folder):
    plan = mo.plan(folder, offload_gb=0)
    tensors = tuple(dataclasses.replace(t, tier="host", host_experts=2) if t.role == "embedding" else t
                    for t in plan.tensors)
    with pytest.raises(MoeOffloadError, match="can go in part"):
        mo.load(folder, plan=dataclasses.replace(plan, tensors=tensors))


def test_audit_checks_the_device_part_shape(folder, plans0):
    model, plan = mo.load(folder, device="cpu", offload_gb=_split_budget(plans0) / GiB)
    runtime = model.moe_offload_runtime
    split = runtime.splits[DOWN]
    runtime.splits[DOWN] = dataclasses.replace(split, resident=split.resident[:1])   # a transform that lost experts
    (mismatch,) = mo.audit(model, plan)
    assert mismatch.name == f"{DOWN}[:3]" and "shape [1, 32, 48]" in mismatch.actual


@pytest.mark.parametrize("backend", ["uva", "prefetch"])
@pytest.mark.parametrize("family, split_tensors", [
    ("gpt_oss", 8),        # one transposed checkpoint tensor for all experts, per-expert biases: 2 x 4 tensors
    ("qwen3_vl_moe", 4),   # fused on disk (transposed only if needed)
    ("granitemoe", 4),     # fused on disk under other names (input_linear / output_linear)
    ("mixtral", 4),        # one checkpoint tensor per expert (w1/w2/w3)
])
def test_every_expert_tensor_split_equals_transformers(models, family, split_tensors, backend):
    """Split every routed-expert tensor (the last 2 of 6 experts on the host) whatever the checkpoint layout."""
    folder = models[family]
    plan = mo.plan(folder, offload_gb=0)
    tensors = tuple(dataclasses.replace(t, tier="host", host_experts=2) if t.role == "routed_expert" else t
                    for t in plan.tensors)
    plan = dataclasses.replace(plan, tensors=tensors)
    model, plan = mo.load(folder, device="cpu", backend=backend, plan=Plan.from_json(plan.to_json()))
    assert len(model.moe_offload_runtime.splits) == split_tensors
    assert model.moe_offload_runtime.arena.nbytes == plan.offloaded_bytes and mo.audit(model, plan) == []
    ids = prompt_ids(folder)
    ref = run(reference_model(folder, family), ids)
    got = run(model, ids)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
