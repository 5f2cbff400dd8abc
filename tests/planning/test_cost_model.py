"""The cost model of where offloaded experts are computed (planning/cost_model.py): a table of cases, each with the
figures worked by hand from the formula in the module's docstring."""

from __future__ import annotations

import pytest

from moe_offload.planning.cost_model import (ExpertCompute, Hardware, LayerShape, choose, crossover_tokens,
                                             expected_step, step_cost)

GB = 1e9
# Qwen3-30B-A3B's routed layer: 128 experts, top 8, each expert 3 x 2048 x 768 bf16 (9,437,184 bytes)
QWEN3 = LayerShape(experts=128, top_k=8, host_expert_bytes=3 * 2048 * 768 * 2, host_fraction=1.0,
                   flops_per_pair=2 * 3 * 2048 * 768, hidden_bytes=2048 * 2)
PCIE4 = Hardware(host_bytes_per_s=80 * GB, host_flops_per_s=1000 * GB, link_bytes_per_s=25 * GB)

# (case, hardware, step keywords, expected choice, host_s, stream_s, activation bytes)
CASES = [
    ("decode: 8 experts of 9.4 MB, host 80 GB/s against PCIe 4",
     PCIE4, dict(tokens=1, pairs=8, weight_bytes=8 * 9_437_184, flops=8 * 9_437_184, hidden_bytes=4096),
     ExpertCompute.HOST, 8 * 9_437_184 / 80e9 + 9 * 4096 / 25e9, 8 * 9_437_184 / 25e9, 9 * 4096),
    ("compute-bound host: the FLOP term wins the max",
     Hardware(80 * GB, 1 * GB, 25 * GB), dict(tokens=1, pairs=8, weight_bytes=8e6, flops=8e9, hidden_bytes=4096),
     ExpertCompute.DEVICE, 8.0 + 9 * 4096 / 25e9, 8e6 / 25e9, 9 * 4096),
    ("a fast link and a slow host: the device",
     Hardware(10 * GB, 1000 * GB, 100 * GB), dict(tokens=1, pairs=2, weight_bytes=2e7, flops=2e7, hidden_bytes=4096),
     ExpertCompute.DEVICE, 2e7 / 10e9 + 3 * 4096 / 100e9, 2e7 / 100e9, 3 * 4096),
    ("the device's own work overlaps either side: both take at least device_s",
     PCIE4, dict(tokens=1, pairs=1, weight_bytes=1e6, flops=1e6, hidden_bytes=4096, device_s=1.0),
     ExpertCompute.DEVICE, 1.0, 1.0, 2 * 4096),
    ("device FLOPs add to streaming",
     Hardware(80 * GB, 1000 * GB, 25 * GB, device_flops_per_s=1 * GB),
     dict(tokens=1, pairs=1, weight_bytes=1e6, flops=1e6, hidden_bytes=4096),
     ExpertCompute.HOST, 1e6 / 80e9 + 2 * 4096 / 25e9, 1e6 / 25e9 + 1e6 / 1e9, 2 * 4096),
    ("no pair on the host: nothing to choose",
     PCIE4, dict(tokens=4, pairs=0, weight_bytes=0, flops=0, hidden_bytes=4096),
     ExpertCompute.DEVICE, 0.0, 0.0, 0),
]


@pytest.mark.parametrize("case,hw,step,choice,host_s,stream_s,activations", CASES, ids=[c[0] for c in CASES])
def test_step_cost(case, hw, step, choice, host_s, stream_s, activations):
    cost = step_cost(hw, **step)
    assert cost.choice is choice
    assert cost.host_s == pytest.approx(host_s, rel=1e-12)
    assert cost.stream_s == pytest.approx(stream_s, rel=1e-12)
    assert cost.activation_bytes == activations
    assert cost.weight_bytes == step["weight_bytes"]


def test_without_a_link_the_device_reads_in_place_and_is_chosen():
    hw = Hardware(80 * GB, 1000 * GB, link_bytes_per_s=None)
    cost = step_cost(hw, tokens=1, pairs=8, weight_bytes=8e7, flops=8e7, hidden_bytes=4096)
    assert cost.choice is ExpertCompute.DEVICE and cost.host_s == cost.stream_s == pytest.approx(8e7 / 80e9)
    assert cost.activation_bytes == 0
    assert crossover_tokens(hw, QWEN3) is None


@pytest.mark.parametrize("mode,choice", [(ExpertCompute.HOST, ExpertCompute.HOST),
                                         (ExpertCompute.DEVICE, ExpertCompute.DEVICE),
                                         (ExpertCompute.AUTO, ExpertCompute.DEVICE)])
def test_a_forced_mode_overrides_the_model(mode, choice):
    cost = step_cost(Hardware(10 * GB, 1000 * GB, 100 * GB), tokens=1, pairs=2, weight_bytes=2e7, flops=2e7,
                     hidden_bytes=4096)
    assert choose(mode, cost) is choice


def test_uniform_routing_expects_the_distinct_experts_of_a_step():
    one = expected_step(PCIE4, QWEN3, 1)
    assert one.weight_bytes == 8 * 9_437_184          # one token: its k experts
    many = expected_step(PCIE4, QWEN3, 4096)
    assert many.weight_bytes == pytest.approx(128 * 9_437_184, rel=1e-6)   # all of them, at most


def test_decode_goes_to_the_host_and_a_long_prefill_to_the_device():
    t = crossover_tokens(PCIE4, QWEN3)
    assert t is not None and 1 < t
    assert expected_step(PCIE4, QWEN3, t - 1).choice is ExpertCompute.HOST
    assert expected_step(PCIE4, QWEN3, t).choice is ExpertCompute.DEVICE
    slower = Hardware(80 * GB, 200 * GB, 25 * GB)      # a host with fewer FLOPs turns sooner
    assert crossover_tokens(slower, QWEN3) < t


def test_a_host_faster_than_the_link_at_every_size_never_crosses():
    hw = Hardware(80 * GB, 1e18, 25 * GB)
    assert crossover_tokens(hw, QWEN3, max_tokens=1024) is None


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf")])
def test_a_rate_must_be_positive(bad):
    with pytest.raises(ValueError, match="positive"):
        Hardware(bad, 1.0, 1.0)


def test_the_layer_shape_of_a_plan(tmp_path):
    """From a plan: its experts, top-k, the off-device share and mean bytes (accounting.TokenBytes) and the FLOPs of a
    pair (2 x the parameters of one expert's weight matrices)."""
    import moe_offload as mo
    from moe_offload.planning.cost_model import layer_shape
    from moe_offload.tiny.make import make_tiny

    folder = make_tiny(tmp_path / "m", family="qwen3_moe", layers=2, experts=8, top_k=2, hidden=64)
    assert layer_shape(mo.plan(folder, offload_gb=0)) is None         # nothing off the device
    plan = mo.plan(folder, offload_gb=0.00105, offload_params="experts")
    shape = layer_shape(plan)
    routed = [t for t in plan.tensors if t.role == "routed_expert" and t.layer == 0]
    params = sum(t.shape[1] * t.shape[2] for t in routed)
    tb = plan.token_bytes()
    off = (tb.expert_host + tb.expert_disk)
    assert (shape.experts, shape.top_k, shape.flops_per_pair) == (8, 2, 2 * params)
    assert shape.host_fraction == pytest.approx((off > 0).mean())
    assert shape.host_expert_bytes == pytest.approx(off[off > 0].mean())
    assert shape.hidden_bytes == 64 * 2
