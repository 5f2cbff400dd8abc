"""Weight transforms keep the placement (the XPU transpose report: .contiguous() on a host view de-offloaded
every expert)."""

import pytest
import torch
import torch.nn as nn

import moe_offload as mo
from moe_offload.errors import AuditError, MoeOffloadError
from moe_offload.tiny.make import make_tiny

# Outputs compared bit for bit with the plain transformers model: `make test` reruns these under a second
# kernel path (see the Makefile).
pytestmark = pytest.mark.exact


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tr") / "m", family="qwen3_moe", layers=2, experts=4, top_k=2, hidden=32)


def _loaded(model_dir):
    full = mo.plan(model_dir)
    experts = next(t for t in full.tensors if t.name.endswith("layers.0.mlp.experts.gate_up_proj"))
    # Budget = exactly layer 0's gate_up_proj: it is the first routed tensor in density order
    # after the embedding, so offload the embedding too.
    emb = next(t for t in full.tensors if t.role == "embedding")
    return mo.load(model_dir, offload_gb=(emb.bytes + experts.bytes) / 2**30)


def _transpose(name, w):
    return w.transpose(-1, -2).contiguous()


def test_transpose_keeps_offloaded_experts_on_host_and_resident_on_device(model_dir):
    model, plan = _loaded(model_dir)
    runtime = model.moe_offload_runtime
    names = [n for n, _ in model.named_parameters() if n.endswith("experts.gate_up_proj")]
    off_name = "model.layers.0.mlp.experts.gate_up_proj"
    assert plan.tiers[off_name] == "host" and plan.tiers["model.layers.1.mlp.experts.gate_up_proj"] == "device"
    before = {n: model.get_parameter(n).detach().clone() for n in names}
    host_before = runtime.arena.nbytes
    mo.transform_weights(model, _transpose, names=names)
    for n in names:
        p = model.get_parameter(n)
        assert torch.equal(p, before[n].transpose(-1, -2))           # numerically the transpose
        assert runtime.arena.owns(p) == (plan.tiers[n] == "host")    # placement kept
    assert runtime.arena.nbytes == host_before                       # same bytes: written in place, no new slab
    assert mo.audit(model, plan) == []


def test_placement_is_tracked_by_name_across_reregistration(model_dir):
    model, plan = _loaded(model_dir)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    experts = model.get_submodule("model.layers.0.mlp.experts")
    # An engine re-registers a fresh Parameter over the same storage: Python attributes of the old one are gone.
    experts._parameters["gate_up_proj"] = nn.Parameter(experts.gate_up_proj.data, requires_grad=False)
    mo.transform_weights(model, _transpose, names=[name])
    assert model.moe_offload_runtime.arena.owns(model.get_parameter(name))
    # A later weight update (RL) in the transformed layout takes the same path: written on the host.
    new = torch.randn_like(model.get_parameter(name))
    mo.update_weights(model, {name: new})
    assert torch.equal(model.get_parameter(name), new)
    assert model.moe_offload_runtime.arena.owns(model.get_parameter(name))


def test_transformed_model_still_generates_like_a_transformed_reference(model_dir):
    model, plan = _loaded(model_dir)
    ids = torch.tensor([[1, 5, 9, 13]])
    with torch.no_grad():
        ref = model(ids).logits
    # Transpose twice: back to the original layout, through the host path both times.
    names = [n for n, _ in model.named_parameters() if "experts" in n]
    mo.transform_weights(model, _transpose, names=names)
    mo.transform_weights(model, _transpose, names=names)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)


def test_naive_contiguous_copy_is_caught_by_the_audit(model_dir):
    model, plan = _loaded(model_dir)
    experts = model.get_submodule("model.layers.0.mlp.experts")
    # What the reported bug did: a new contiguous tensor replaces the host view.
    experts._parameters["gate_up_proj"] = nn.Parameter(experts.gate_up_proj.transpose(-1, -2).contiguous())
    mismatches = mo.audit(model, plan)
    assert [(m.name, m.planned, m.actual) for m in mismatches] == [
        ("model.layers.0.mlp.experts.gate_up_proj", "host", "device")]
    # qwen3_moe tiny, hidden 32: gate_up_proj [4 experts, 2 x 48, 32] fp32 = 4 * 96 * 32 * 4 bytes
    assert mismatches[0].bytes == 4 * 96 * 32 * 4
    with pytest.raises(AuditError, match="gate_up_proj"):
        mo.update_weights(model, {})


def test_bad_transform_inputs(model_dir):
    model, plan = _loaded(model_dir)
    with pytest.raises(MoeOffloadError, match="not tensors"):
        mo.transform_weights(model, _transpose, names=["nope.weight"])
    with pytest.raises(MoeOffloadError, match="shape"):
        mo.update_weights(model, {"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(1)})
    with pytest.raises(MoeOffloadError, match="not loaded by moe_offload"):
        mo.transform_weights(nn.Linear(2, 2), _transpose)
