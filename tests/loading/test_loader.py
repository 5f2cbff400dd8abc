"""moe_offload.load: the offloaded model computes exactly what transformers computes, with every tensor
where the plan put it, and every bad input is a named error.

Models: `fixtures_models` (make_tiny, hidden 32, 2 layers, 6 experts, top-2, float32). The reference is
the plain transformers model (fp32, CPU, eager experts); offloaded outputs must be bit-identical to it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import moe_offload as mo
from fixtures_models import (load, ARMS, BACKENDS, FAMILIES, TIED_IDS, TIED_VOCAB, budgets, make_tied,
                             prompt_ids, reference_model, run, tensor_bytes)
from moe_offload.errors import (BudgetError, CheckpointError, ConfigError, DeviceError, MoeOffloadError,
                                SelectorError)
from moe_offload.planning.placement import GiB

# Outputs compared bit for bit with the plain transformers model: `make test` reruns these under a second
# kernel path (see the Makefile).
pytestmark = pytest.mark.exact


@pytest.fixture(scope="module")
def references(models):
    """family -> (prompt ids, greedy tokens, per-step logits, prefill logits) of the plain transformers model."""
    cache = {}

    def get(family):
        if family not in cache:
            ids = prompt_ids(models[family])
            cache[family] = (ids, *run(reference_model(models[family], family), ids))
        return cache[family]

    return get


def _assert_same_outputs(model, ref):
    ids, tokens, step_logits, prefill = ref
    got_tokens, got_steps, got_prefill = run(model, ids)
    assert torch.equal(got_tokens, tokens), (got_tokens, tokens)
    assert torch.equal(got_steps, step_logits), (got_steps - step_logits).abs().max()
    assert torch.equal(got_prefill, prefill), (got_prefill - prefill).abs().max()


def _live_tensors(model) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}


# --- outputs equal the reference ------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arm", ARMS)
@pytest.mark.parametrize("family", FAMILIES)
def test_offloaded_outputs_equal_transformers(models, references, plans0, family, arm, backend):
    opts = budgets(plans0(family))[arm]
    model, plan = load(models[family], backend=backend, **opts)
    host = [t for t in plan.tensors if t.tier == "host"]
    # The arm offloads what it is meant to (so the comparison below covers that case).
    roles_host = {t.role for t in host}
    roles_device = {t.role for t in plan.tensors if t.tier == "device"}
    if arm == "resident":
        assert host == []
    elif arm == "all":
        assert roles_device == set()
    elif arm == "sparse-partial":
        assert "routed_expert" in roles_host and "routed_expert" in roles_device
        assert roles_host <= {"routed_expert", "embedding"}
    else:  # sparse-first, declaration: some experts and some dense tensors on the host
        assert "routed_expert" in roles_host
        assert roles_host - {"routed_expert", "embedding"}, roles_host
    if arm == "declaration":
        assert "routed_expert" in roles_device  # only the first expert tensor in declaration order went
    _assert_same_outputs(model, references(family))


# --- placement ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arm", ["sparse-first", "declaration", "all"])
@pytest.mark.parametrize("family", FAMILIES)
def test_placement_matches_plan(models, plans0, family, arm, backend):
    model, plan = load(models[family], backend=backend, **budgets(plans0(family))[arm])
    runtime = model.moe_offload_runtime
    assert mo.audit(model, plan) == []
    live = _live_tensors(model)
    host_bytes = 0
    for t in plan.tensors:
        x = live[t.name]
        assert tuple(x.shape) == tuple(t.shape), t.name
        if t.tier == "host":
            assert runtime.arena.owns(x), f"{t.name} is planned host but not in the arena"
            host_bytes += tensor_bytes(x)
        else:
            assert t.tier == "device"
            assert not runtime.arena.owns(x), f"{t.name} is planned device but lies in the arena"
            assert x.device.type == "cpu"
    assert host_bytes == plan.offloaded_bytes > 0
    # Exact-size host memory: the arena holds the offloaded bytes plus alignment padding only.
    assert plan.offloaded_bytes <= runtime.arena.nbytes <= plan.offloaded_bytes * 1.01


def test_budget_is_met_with_overshoot_below_last_tensor(models, plans0):
    plan0 = plans0("qwen3_moe")
    # 20000 bytes: the embedding (65536 B, density 1/512) comes first and alone crosses it.
    model, plan = load(models["qwen3_moe"], offload_gb=20000 / GiB)
    assert plan.budget_bytes == 20000
    assert [t.name for t in plan.tensors if t.tier == "host"] == ["model.embed_tokens.weight"]
    assert model.moe_offload_runtime.arena.nbytes == 512 * 32 * 4
    # 65536 + 1 bytes: the embedding and one expert of the routed tensor with the smallest expert slice
    # (down_proj: 32 x 48 x 4 = 6144 B per expert, gate_up_proj's are 12288 B): its last of 6 experts.
    model, plan = load(models["qwen3_moe"], offload_gb=65537 / GiB)
    assert [t.name for t in plan.tensors if t.tier == "host"] == [
        "model.embed_tokens.weight", "model.layers.0.mlp.experts.down_proj"]
    assert {t.name: t.host_experts for t in plan.tensors if t.host_experts} == {
        "model.layers.0.mlp.experts.down_proj": 1}
    assert plan.offloaded_bytes == 65536 + 6144
    assert model.moe_offload_runtime.arena.nbytes == 65536 + 6144
    assert plan0.total_bytes > plan.offloaded_bytes


def test_placement_survives_generation(models, plans0):
    model, plan = load(models["gpt_oss"], backend="prefetch", **budgets(plans0("gpt_oss"))["all"])
    run(model, prompt_ids(models["gpt_oss"]), new_tokens=3)
    assert mo.audit(model, plan) == []


# --- tied embeddings ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory):
    folder = make_tied(tmp_path_factory.mktemp("tied") / "qwen3_moe_tied")
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())  # transformers stores the tied table once
    return folder


def _tied_reference(folder):
    return (TIED_IDS, *run(reference_model(folder, "qwen3_moe"), TIED_IDS))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("budget", ["resident", "embedding", "all"])
def test_tied_embeddings_stay_tied(tied_model, backend, budget):
    plan0 = mo.plan(tied_model)
    embed = TIED_VOCAB * 32 * 4
    opts = {"resident": dict(offload_gb=0),
            # Declaration order: the tied table is the first tensor, and exactly fills the budget.
            "embedding": dict(offload_gb=embed / GiB, policy="declaration"),
            "all": dict(offload_gb=plan0.total_bytes / GiB)}[budget]
    model, plan = load(tied_model, backend=backend, **opts)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head.weight" not in plan.tiers  # one tensor, planned once
    if budget != "resident":
        assert plan.tiers["model.embed_tokens.weight"] == "host"
        assert model.moe_offload_runtime.arena.owns(model.lm_head.weight)
    assert mo.audit(model, plan) == []
    _assert_same_outputs(model, _tied_reference(tied_model))
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied after running


# --- sharded checkpoints --------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_sharded_checkpoint(models, references, plans0, tmp_path, backend):
    src = models["qwen3_moe"]
    folder = tmp_path / "sharded"
    reference_model(src, "qwen3_moe").save_pretrained(folder, max_shard_size="60KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 4
    # A fused in-memory tensor is filled from per-expert tensors that live in more than one shard.
    experts_files = {f for k, f in index["weight_map"].items() if ".layers.0.mlp.experts." in k}
    assert len(experts_files) >= 2
    model, plan = load(folder, backend=backend, **budgets(plans0("qwen3_moe"))["sparse-first"])
    assert mo.audit(model, plan) == []
    assert plan.tiers == mo.plan(src, **budgets(plans0("qwen3_moe"))["sparse-first"]).tiers
    _assert_same_outputs(model, references("qwen3_moe"))


# --- plans given to load --------------------------------------------------------------------------------------


def test_load_with_plan_object_and_json(models, references, plans0, tmp_path):
    folder = models["mixtral"]
    plan = mo.plan(folder, **budgets(plans0("mixtral"))["sparse-first"])
    model, used = load(folder, plan=plan, backend="prefetch")
    assert used.tiers == plan.tiers and used.offloaded_bytes == plan.offloaded_bytes
    assert mo.audit(model, plan) == []
    assert model.moe_offload_runtime.arena.nbytes >= plan.offloaded_bytes > 0
    _assert_same_outputs(model, references("mixtral"))

    saved = tmp_path / "plan.json"
    saved.write_text(plan.to_json())
    for given in (saved, str(saved)):
        model, used = load(folder, plan=given)
        assert used.tiers == plan.tiers
        assert used.budget_bytes == plan.budget_bytes and used.policy == plan.policy
        assert mo.audit(model, plan) == []
    _assert_same_outputs(model, references("mixtral"))


def test_plan_for_another_model_is_rejected(models, tmp_path):
    other = mo.plan(models["mixtral"], offload_gb=0)
    with pytest.raises(MoeOffloadError, match="another model"):
        load(models["qwen3_moe"], plan=other)
    # Same tensor names, other shapes: a qwen3_moe with hidden 48.
    from moe_offload.tiny.make import make_tiny

    wider = make_tiny(tmp_path / "wide", family="qwen3_moe", layers=2, experts=6, top_k=2, hidden=48)
    with pytest.raises(MoeOffloadError, match="shape"):
        load(models["qwen3_moe"], plan=mo.plan(wider, offload_gb=0))


def test_plan_and_budget_together_are_rejected(models):
    plan = mo.plan(models["qwen3_moe"], offload_gb=0)
    with pytest.raises(SelectorError, match="plan"):
        load(models["qwen3_moe"], plan=plan, offload_gb=0.0001)
    with pytest.raises(SelectorError, match="plan"):
        load(models["qwen3_moe"], plan=plan, policy="declaration")


def test_malformed_plan_file(models, tmp_path):
    bad = tmp_path / "plan.json"
    bad.write_text('{"tensors": 3}')
    with pytest.raises(MoeOffloadError, match="plan"):
        load(models["qwen3_moe"], plan=bad)


# --- bad input ------------------------------------------------------------------------------------------------


@pytest.fixture
def copy_of(models, tmp_path):
    """copy_of(family) -> a private copy of that model folder, safe to damage."""
    def copy(family="qwen3_moe"):
        dest = tmp_path / f"{family}_copy"
        shutil.copytree(models[family], dest)
        return dest
    return copy


def _no_result(folder, error, match, **kw):
    with pytest.raises(error, match=match) as info:
        load(folder, **kw)
    assert isinstance(info.value, MoeOffloadError)
    return str(info.value)


def _rewrite(folder: Path, change):
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_missing_shard(models, tmp_path):
    folder = tmp_path / "sharded"
    reference_model(models["qwen3_moe"], "qwen3_moe").save_pretrained(folder, max_shard_size="60KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[1]
    (folder / gone).unlink()
    message = _no_result(folder, CheckpointError, "missing", offload_gb=0)
    assert gone in message


def test_truncated_safetensors(copy_of):
    folder = copy_of()
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    message = _no_result(folder, CheckpointError, "model.safetensors", offload_gb=0)
    assert "truncated" in message or "corrupt" in message


def test_shape_mismatch(copy_of):
    folder = copy_of()
    key = "model.layers.1.self_attn.o_proj.weight"  # (32, 32) in the model
    _rewrite(folder, lambda t: t.__setitem__(key, torch.zeros(32, 30)))
    message = _no_result(folder, CheckpointError, "shape", offload_gb=0)
    assert key in message


def test_expert_shape_mismatch(copy_of):
    folder = copy_of()
    key = "model.layers.0.mlp.experts.4.down_proj.weight"  # (32, 48) per expert on disk
    _rewrite(folder, lambda t: t.__setitem__(key, torch.zeros(48, 32)))
    message = _no_result(folder, CheckpointError, "shape", offload_gb=0)
    assert key in message


def test_missing_key(copy_of):
    folder = copy_of()
    key = "model.layers.1.post_attention_layernorm.weight"
    _rewrite(folder, lambda t: t.pop(key))
    message = _no_result(folder, CheckpointError, "checkpoint", offload_gb=0)
    assert key in message


def test_missing_expert(copy_of):
    folder = copy_of()
    _rewrite(folder, lambda t: t.pop("model.layers.1.mlp.experts.5.gate_proj.weight"))
    message = _no_result(folder, CheckpointError, "checkpoint", offload_gb=0)
    assert "model.layers.1.mlp.experts.gate_up_proj" in message


def test_unexpected_key(copy_of):
    folder = copy_of()
    key = "model.layers.0.mlp.bogus.weight"
    _rewrite(folder, lambda t: t.__setitem__(key, torch.zeros(4, 4)))
    message = _no_result(folder, CheckpointError, "match no tensor", offload_gb=0)
    assert key in message


def test_missing_folder(tmp_path):
    missing = tmp_path / "nowhere"
    message = _no_result(missing, ConfigError, "nowhere", offload_gb=0)
    assert "folder" in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_absent_device(models):
    _no_result(models["qwen3_moe"], DeviceError, "cuda", device="cuda", offload_gb=0)


def test_nonexistent_device(models):
    _no_result(models["qwen3_moe"], DeviceError, "cuda:64", device="cuda:64", offload_gb=0)
    _no_result(models["qwen3_moe"], DeviceError, "warp", device="warp", offload_gb=0)


def test_unknown_backend(models):
    _no_result(models["qwen3_moe"], DeviceError, "zerocopy", backend="zerocopy", offload_gb=0)


def test_unknown_dtype(models):
    _no_result(models["qwen3_moe"], ConfigError, "fp8", dtype="fp8", offload_gb=0)


def test_impossible_budget(models, plans0):
    total = plans0("qwen3_moe").total_bytes
    message = _no_result(models["qwen3_moe"], BudgetError, "offload_gb=", offload_gb=(total + 1) / GiB)
    assert str(total) in message
    _no_result(models["qwen3_moe"], BudgetError, "non-negative", offload_gb=-1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dtype_override_plans_and_loads_in_that_dtype(models, backend):
    folder = models["qwen3_moe"]
    fp32 = mo.plan(folder)
    # A bf16 plan of the same fp32 checkpoint: every floating tensor at 2 bytes per element.
    plan = mo.plan(folder, dtype="bf16", offload_gb=fp32.total_bytes / 4 / GiB)
    assert {t.dtype for t in plan.tensors} == {"bfloat16"}
    assert plan.total_bytes == fp32.total_bytes // 2
    model, loaded = mo.load(folder, dtype="bf16", backend=backend, offload_gb=fp32.total_bytes / 4 / GiB)
    assert loaded.tiers == plan.tiers
    assert model.moe_offload_runtime.arena.nbytes == loaded.offloaded_bytes
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert mo.audit(model, loaded) == []
    import transformers
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16,
                                                            experts_implementation="eager").eval()
    ref.requires_grad_(False)
    ids = torch.tensor([[1, 5, 9, 13, 17]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


def test_move_buffers_leaves_placed_buffers_in_their_tier():
    """Computed buffers follow the model to its device; a buffer already placed (e.g. offloaded) stays put.
    (No second device here: `meta` stands in for the accelerator.)"""
    from torch import nn

    from moe_offload.loading.loader import _move_buffers

    model = nn.Module()
    model.register_buffer("placed", torch.ones(2))
    model.register_buffer("computed", torch.ones(2), persistent=False)
    _move_buffers(model, torch.device("meta"), {"placed"})
    assert model.placed.device.type == "cpu" and model.computed.device.type == "meta"


def test_plan_with_a_disk_tier_leaves_it_in_the_checkpoint(models):
    import dataclasses

    plan = mo.plan(models["qwen3_moe"])
    first = dataclasses.replace(plan.tensors[0], tier="disk")
    model, plan = load(models["qwen3_moe"], plan=dataclasses.replace(plan, tensors=(first, *plan.tensors[1:])))
    assert mo.audit(model, plan) == []    # read at run time (tests/test_disk_tier.py), not at load
    assert dict(model.named_parameters())[first.name].device.type == "meta"


def test_plan_of_another_format_is_refused(models, tmp_path):
    data = json.loads(mo.plan(models["qwen3_moe"]).to_json())
    data["format"] = 99
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(MoeOffloadError, match="format 99"):
        mo.load(models["qwen3_moe"], plan=tmp_path / "p.json")


def test_plan_with_unset_budget_options_is_accepted(models, plans0):
    # Callers forwarding their own options pass None for the ones they did not set.
    model, plan = mo.load(models["qwen3_moe"], plan=plans0("qwen3_moe"), offload_gb=None, device_memory_gb=None)
    assert plan == plans0("qwen3_moe")
