"""wrap_modules: streaming offload as modules are built, one budget across calls."""

import pytest
import torch
import torch.nn as nn

from moe_offload import Offloader, Plan
from moe_offload.errors import BudgetError, MoeOffloadError, SelectorError
from moe_offload.planning.placement import GiB

# Toy layer, fp32:
#   self_attn.q_proj.weight  [8, 8]     =   256 bytes (dense)
#   mlp.experts.gate_up_proj [4, 16, 8] = 2,048 bytes (routed)
#   mlp.experts.down_proj    [4, 8, 8]  = 1,024 bytes (routed)
ATTN, GATE_UP, DOWN = 256, 2048, 1024
EXPERTS = GATE_UP + DOWN


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(4, 16, 8))
        self.down_proj = nn.Parameter(torch.randn(4, 8, 8))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(8, 8, bias=False)
        self.mlp = nn.Module()
        self.mlp.experts = Experts()


class VisionBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(8, 8, bias=False)  # 256 bytes, dense


def resident_bytes(modules, off):
    return sum(p.numel() * p.element_size() for m in modules for p in m.parameters() if not off.arena.owns(p))


def test_offloads_each_module_before_the_next_is_built():
    off = Offloader(offload_gb=3 * EXPERTS / GiB)
    events, built = [], []

    def gen():
        for i in range(3):
            events.append(("build", i))
            layer = Layer()
            built.append(layer)
            yield layer
            # Back in the generator: module i must already be offloaded, before module i+1 is built.
            events.append(("offloaded", i, off.tiers()[f"model.layers.{i}.mlp.experts.down_proj"]))

    peak = []

    def watched():
        for layer in gen():
            # Device bytes now: everything built so far that is not in the host arena.
            peak.append(resident_bytes(built, off))
            yield layer

    layers = off.wrap_modules(watched(), prefix="model.layers")
    assert events == [("build", 0), ("offloaded", 0, "host"), ("build", 1), ("offloaded", 1, "host"),
                      ("build", 2), ("offloaded", 2, "host")]
    one_module = ATTN + EXPERTS
    # planned resident bytes: the attention of every layer built before, plus the module just built
    for i, observed in enumerate(peak):
        assert observed <= i * ATTN + one_module
    assert len(layers) == 3 and off.offloaded_bytes == 3 * EXPERTS


def test_eager_generator_consumption_would_be_caught():
    """A consumer that lists the generator first would see module 0 still on the device when module 1 is built."""
    off = Offloader(offload_gb=EXPERTS / GiB)
    seen = []

    def gen():
        for i in range(2):
            if i == 1:
                seen.append(off.tiers().get("0.mlp.experts.gate_up_proj"))
            yield Layer()

    off.wrap_modules(gen())
    assert seen == ["host"]


def test_dense_only_in_finalize_and_budget_shared_across_calls():
    # Budget: all experts of both layers + one dense tensor's worth.
    off = Offloader(offload_gb=(2 * EXPERTS + ATTN) / GiB)
    # A vision tower wrapped FIRST: its dense tensors must not take budget from the experts.
    off.wrap_modules((VisionBlock() for _ in range(2)), prefix="model.visual.blocks")
    assert all(t == "device" for t in off.tiers().values())
    off.wrap_modules((Layer() for _ in range(2)), prefix="model.layers")
    tiers = off.tiers()
    assert tiers["model.layers.1.mlp.experts.gate_up_proj"] == "host"
    assert tiers["model.layers.0.self_attn.q_proj.weight"] == "device"  # dense waits for finalize
    off.finalize()
    tiers = off.tiers()
    # Remaining budget (256 bytes) spills to the first dense tensor in declaration order: the tower's.
    assert tiers["model.visual.blocks.0.attn.weight"] == "host"
    assert tiers["model.visual.blocks.1.attn.weight"] == "device"
    assert tiers["model.layers.0.self_attn.q_proj.weight"] == "device"
    assert off.offloaded_bytes == 2 * EXPERTS + ATTN


def test_budget_below_experts_leaves_tower_resident_even_after_finalize():
    off = Offloader(offload_gb=EXPERTS / GiB)
    off.wrap_modules((VisionBlock() for _ in range(2)), prefix="model.visual.blocks")
    off.wrap_modules((Layer() for _ in range(2)), prefix="model.layers")
    off.finalize()
    tiers = off.tiers()
    assert [n for n, t in tiers.items() if t == "host"] == ["model.layers.0.mlp.experts.gate_up_proj",
                                                            "model.layers.0.mlp.experts.down_proj"]


def test_offloaded_weights_keep_values_and_forward():
    torch.manual_seed(0)
    ref = Layer()
    off = Offloader(offload_gb=EXPERTS / GiB)
    clone = Layer()
    clone.load_state_dict(ref.state_dict())
    (layer,) = off.wrap_modules(iter([clone]), prefix="L")
    assert off.arena.owns(layer.mlp.experts.gate_up_proj)
    assert torch.equal(layer.mlp.experts.gate_up_proj, ref.mlp.experts.gate_up_proj)
    assert off.arena.nbytes == EXPERTS  # exact size: host memory equals the offloaded bytes


def test_with_plan_each_tensor_goes_to_its_tier():
    tiers = {"0.self_attn.q_proj.weight": "host", "0.mlp.experts.gate_up_proj": "device",
             "0.mlp.experts.down_proj": "host"}
    plan = _plan_with(tiers)
    off = Offloader(plan=plan)
    off.wrap_modules(iter([Layer()]))
    off.finalize()  # no-op with a plan
    assert off.tiers() == tiers
    assert off.offloaded_bytes == ATTN + DOWN


def test_plan_with_other_names_is_an_error():
    off = Offloader(plan=_plan_with({"x.weight": "host"}))
    with pytest.raises(MoeOffloadError, match="no tier"):
        off.wrap_modules(iter([Layer()]))


def test_declaration_policy_and_selectors():
    off = Offloader(offload_gb=ATTN / GiB, policy="declaration")
    off.wrap_modules(iter([Layer()]))
    assert off.tiers()["0.self_attn.q_proj.weight"] == "host"  # legacy order: dense first

    off = Offloader(offload_gb=DOWN / GiB, offload_params=["experts.down_proj"])
    off.wrap_modules(iter([Layer()]))
    off.finalize()
    assert [n for n, t in off.tiers().items() if t == "host"] == ["0.mlp.experts.down_proj"]

    # A string is one selector, as in mo.plan (not the letters e, x, p, ...).
    off = Offloader(offload_gb=DOWN / GiB, offload_params="experts.down_proj")
    off.wrap_modules(iter([Layer()]))
    off.finalize()
    assert [n for n, t in off.tiers().items() if t == "host"] == ["0.mlp.experts.down_proj"]

    off = Offloader(offload_gb=DOWN / GiB, offload_params=["expert"])
    off.wrap_modules(iter([Layer()]))
    with pytest.raises(SelectorError, match="matched no tensor"):
        off.finalize()


def test_bad_options():
    with pytest.raises(BudgetError):
        Offloader(offload_gb=-1)
    with pytest.raises(SelectorError):
        Offloader(offload_gb=1, policy="random")
    with pytest.raises(MoeOffloadError):
        Offloader(offload_gb=1, plan=_plan_with({}))


def _plan_with(tiers):
    from moe_offload.planning.placement import PlannedTensor

    tensors = tuple(PlannedTensor(n, (1,), "float32", 4, None, "language", "other", False, None, None, t, "test")
                    for n, t in tiers.items())
    return Plan(tensors, "toy", "sparse-first", 0)


def test_an_offloader_without_budget_or_plan_is_refused():
    with pytest.raises(BudgetError, match="neither a plan nor offload_gb"):
        Offloader()


def test_a_plan_with_a_disk_tier_is_refused():
    with pytest.raises(MoeOffloadError, match="disk tier is not implemented"):
        Offloader(plan=_plan_with({"0.mlp.experts.down_proj": "disk"}))
