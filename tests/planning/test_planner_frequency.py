"""`policy="frequency"`: expert-granular placement from routing statistics, on hand-made statistics.

Toy model of tests/test_planner.py (bfloat16, E=4, top-k 2). Per layer: dense 352 B; one expert's slices of
gate_up_proj (128 B) and down_proj (64 B) = 192 B, the unit of placement. Embedding (16, 8) 256 B, density 1/16.

Densities (FREQUENCY_PSEUDOCOUNT a = 1): p_e = k (c_e + 1) / (sum c + E). With the statistics STATS below
(20 picks per layer, sum c + E = 24):
    layer 0 counts [10, 0, 5, 5] -> p = [11/12, 1/12, 1/2, 1/2]      (expert 1 never picked: 1/12, not 0)
    layer 1 counts [3, 3, 7, 7]  -> p = [1/3, 1/3, 2/3, 2/3]
Order: embedding 1/16, L0e1 1/12, L1e0 1/3, L1e1 1/3, L0e2 1/2, L0e3 1/2, L1e2 2/3, L1e3 2/3, L0e0 11/12, dense.
"""

from __future__ import annotations

import json

import pytest

from moe_offload.errors import SelectorError
from moe_offload.planning.frequency import FREQUENCY_PSEUDOCOUNT, expert_densities
from moe_offload.planning.planner import plan
from moe_offload.planning.placement import Plan
from fixtures_records import EMBED, FINAL_NORM, LM_HEAD, dense_layer, gb, host, layer, make_inv

INV = make_inv([EMBED, *layer(0), *layer(1), FINAL_NORM, LM_HEAD])   # 2768 B
STATS = {0: [10, 0, 5, 5], 1: [3, 3, 7, 7]}
UNIT = 192
ORDER = [(0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3), (0, 0)]   # (layer, expert), lowest density first


def ids(p: Plan) -> dict[str, tuple[int, ...]]:
    return {t.name: t.host_expert_ids for t in p.tensors if t.host_expert_ids}


def experts_on_host(p: Plan) -> set[tuple[int, int]]:
    out = set()
    for t in p.tensors:
        if t.name.endswith("down_proj"):
            gate_up = next(u for u in p.tensors if u.name == t.name.replace("down_proj", "gate_up_proj"))
            assert t.host_expert_ids == gate_up.host_expert_ids   # the two slices of an expert go together
            out |= {(t.layer, x) for x in t.host_expert_ids}
    return out


def test_densities_by_hand():
    assert FREQUENCY_PSEUDOCOUNT == 1.0
    assert expert_densities([10, 0, 5, 5], 2) == pytest.approx([11 / 12, 1 / 12, 1 / 2, 1 / 2])
    assert expert_densities([0, 0, 0, 0], 2) == (0.5, 0.5, 0.5, 0.5)          # no statistics: uniform k/E
    assert expert_densities([9, 9, 9, 9], 4) == (1.0, 1.0, 1.0, 1.0)          # top_k = E: every expert, every token
    assert sum(expert_densities([40, 23, 0, 17], 2)) == pytest.approx(2.0)   # 40 tokens: sums to top_k like k/E


@pytest.mark.parametrize("n", range(len(ORDER) + 1))
def test_units_go_lowest_density_first_across_layers(n):
    # the embedding (256 B) and then n expert units of 192 B, exactly
    p = plan(INV, offload_gb=gb(256 + n * UNIT), policy="frequency", stats=STATS)
    assert experts_on_host(p) == set(ORDER[:n])
    assert p.offloaded_bytes == 256 + n * UNIT and p.budget_bytes == 256 + n * UNIT
    assert "model.embed_tokens.weight" in host(p)
    assert not [t for t in p.tensors if t.tier == "host" and t.role not in ("routed_expert", "embedding")]


def test_host_expert_ids_counts_and_tiers():
    p = plan(INV, offload_gb=gb(256 + 5 * UNIT), policy="frequency", stats=STATS)
    assert ids(p) == {"model.layers.0.mlp.experts.gate_up_proj": (1, 2, 3),
                      "model.layers.0.mlp.experts.down_proj": (1, 2, 3),
                      "model.layers.1.mlp.experts.gate_up_proj": (0, 1), "model.layers.1.mlp.experts.down_proj": (0, 1)}
    t = next(t for t in p.tensors if t.name == "model.layers.0.mlp.experts.gate_up_proj")
    assert (t.tier, t.host_experts, t.host_ids, t.offloaded_bytes) == ("host", 3, (1, 2, 3), 3 * 128)
    assert "3 of 4 experts" in t.reason


def test_budget_accounting_and_overshoot_below_one_unit():
    # 1 byte past the embedding + 3 units: the 4th unit (L0e2) goes too; overshoot 191 B < 192 B
    p = plan(INV, offload_gb=gb(256 + 3 * UNIT + 1), policy="frequency", stats=STATS)
    assert p.offloaded_bytes == 256 + 4 * UNIT and p.budget_bytes == 256 + 3 * UNIT + 1
    assert any("191 bytes more than the budget" in n and "expert 2 of layer 0" in n for n in p.notes)
    # link bytes: a row (16) + 192 x (1/12 + 1/3 + 1/3 + 1/2) = 16 + 240
    assert p.link_bytes_per_token() == pytest.approx(16 + 240)


def test_an_expert_never_seen_is_not_density_zero_but_still_goes_first():
    # With 2000 picks, the unseen expert has p = 2 x 1/2004 < 1/16: it goes before the embedding table.
    stats = {0: [1000, 0, 500, 500], 1: [500, 500, 500, 500]}
    p = plan(INV, offload_gb=gb(UNIT), policy="frequency", stats=stats)
    assert experts_on_host(p) == {(0, 1)} and "model.embed_tokens.weight" not in host(p)
    assert p.link_bytes_per_token() == pytest.approx(UNIT * 2 / 2004)
    assert any("1 experts never picked" in n for n in p.notes)


def test_ties_go_by_layer_then_expert_id():
    stats = {0: [5, 5, 5, 5], 1: [5, 5, 5, 5]}   # all p = 1/2
    p = plan(INV, offload_gb=gb(256 + 5 * UNIT), policy="frequency", stats=stats)
    assert experts_on_host(p) == {(0, 0), (0, 1), (0, 2), (0, 3), (1, 0)}


def test_a_layer_with_every_expert_hot_competes_with_dense_and_goes_first():
    # top_k = E = 4: every token reads every expert (p = 1), the same density as a dense tensor. Experts
    # still go before dense tensors of equal density; then dense ones in declaration order.
    inv = make_inv([*layer(0)], top_k=4)
    p = plan(inv, offload_gb=gb(768 + 16), policy="frequency", stats={0: [7, 7, 7, 7]})
    assert experts_on_host(p) == {(0, 0), (0, 1), (0, 2), (0, 3)}
    assert host(p) == ["model.layers.0.input_layernorm.weight", "model.layers.0.mlp.experts.gate_up_proj",
                       "model.layers.0.mlp.experts.down_proj"]
    t = next(t for t in p.tensors if t.name.endswith("gate_up_proj"))
    assert t.host_experts == 4 and t.host_expert_ids == (0, 1, 2, 3) and t.offloaded_bytes == 512
    assert p.link_bytes_per_token() == pytest.approx(768 + 16)


def test_a_layer_may_go_whole_while_another_keeps_only_its_hot_experts():
    # Densities average k/E in every layer, so a layer goes whole only below another layer's cold experts:
    # layer 0 [0, 0, 1, 1] -> p = [1/3, 1/3, 2/3, 2/3]; layer 1 (100 tokens) [100, 100, 0, 0] -> p = [202/204,
    # 202/204, 2/204, 2/204]. Order: L1e2, L1e3, L0e0, L0e1, L0e2, L0e3, L1e0, L1e1.
    stats = {0: [0, 0, 1, 1], 1: [100, 100, 0, 0]}
    p = plan(INV, offload_gb=gb(256 + 6 * UNIT), policy="frequency", stats=stats)
    assert experts_on_host(p) == {(0, 0), (0, 1), (0, 2), (0, 3), (1, 2), (1, 3)}
    assert ids(p)["model.layers.0.mlp.experts.down_proj"] == (0, 1, 2, 3)
    assert ids(p)["model.layers.1.mlp.experts.down_proj"] == (2, 3)
    # link bytes: row 16 + 192 x (1/3 + 1/3 + 2/3 + 2/3 + 2 x 2/204)
    assert p.link_bytes_per_token() == pytest.approx(16 + UNIT * (2 + 4 / 204))


def test_dense_tensors_come_after_every_expert_as_in_sparse_first():
    p = plan(INV, offload_gb=gb(256 + 8 * UNIT + 16), policy="frequency", stats=STATS)
    dense = [t.name for t in p.tensors if t.tier == "host" and t.role not in ("routed_expert", "embedding")]
    assert dense == ["model.layers.0.input_layernorm.weight"]
    assert any(n.startswith("dense tensors offloaded") for n in p.notes)


def test_a_routed_tensor_that_is_not_a_fused_expert_stack_goes_whole_at_k_over_e():
    # An expert bias outside a fused experts module (no expert axis the planner may split): 4 x 16 bf16 = 128 B,
    # density k/E = 1/2, declared after layer 0's experts: it follows L0e2 and L0e3 (also 1/2, declared earlier).
    bias = ("model.layers.0.mlp.experts.extra_bias", (4, 16), "bfloat16", "")
    inv = make_inv([*layer(0), bias])
    stats = {0: [5, 5, 5, 5]}
    p = plan(inv, offload_gb=gb(4 * UNIT + 1), policy="frequency", stats=stats)
    t = next(t for t in p.tensors if t.name.endswith("extra_bias"))
    assert t.tier == "host" and t.host_experts == 0 and t.host_expert_ids == () and p.offloaded_bytes == 4 * UNIT + 128
    p = plan(inv, offload_gb=gb(3 * UNIT), policy="frequency", stats=stats)
    assert next(t for t in p.tensors if t.name.endswith("extra_bias")).tier == "device"


def test_batch_raises_densities_but_keeps_the_order():
    p = plan(INV, offload_gb=gb(256 + 3 * UNIT), policy="frequency", stats=STATS, batch=4)
    assert experts_on_host(p) == set(ORDER[:3])
    # per step of 4 tokens: 4 rows + 192 x [1 - (11/12)^4 + 2 (1 - (2/3)^4)], per token
    step = 4 * 16 + UNIT * ((1 - (11 / 12) ** 4) + 2 * (1 - (2 / 3) ** 4))
    assert p.link_bytes_per_token() == pytest.approx(step / 4)


def test_device_memory_budget():
    # 2768 B of weights in (2768 - 500) B of room: 500 B to offload -> embedding + 2 units (640 B)
    p = plan(INV, device_memory_gb=gb(2768 - 500), reserve_gb=0, policy="frequency", stats=STATS)
    assert experts_on_host(p) == set(ORDER[:2]) and p.offloaded_bytes == 640


def test_json_round_trip_keeps_ids_densities_and_link_bytes():
    p = plan(INV, offload_gb=gb(256 + 3 * UNIT), policy="frequency", stats=STATS)
    doc = json.loads(p.to_json())
    assert doc["policy"] == "frequency"
    assert doc["expert_densities"] == {"0": list(expert_densities(STATS[0], 2)),
                                       "1": list(expert_densities(STATS[1], 2))}
    assert [t["host_expert_ids"] for t in doc["tensors"] if t["host_expert_ids"]] == [[1], [1], [0, 1], [0, 1]]
    back = Plan.from_json(p.to_json())
    assert back == p and back.link_bytes_per_token() == p.link_bytes_per_token()
    # the frequency-weighted expectation, not uniform: row 16 + 192 x (1/12 + 2/3) = 160; uniform would be 304
    assert p.link_bytes_per_token() == pytest.approx(160)


@pytest.mark.parametrize("kwargs,message", [
    (dict(policy="frequency"), r"--policy frequency needs --stats TRACE"),
    (dict(policy="sparse-first", stats=STATS), r"--stats only applies with --policy frequency"),
    (dict(policy="oracle", stats=STATS), r"only `moe-offload replay` takes it"),
    (dict(policy="frequency", stats={0: [1, 2, 3, 4]}), r"cover layers \[0\] but this qwen3_moe model routes "
                                                        r"layers \[0, 1\]"),
    (dict(policy="frequency", stats={**STATS, 2: [1, 1, 1, 1]}), r"cover layers \[0, 1, 2\]"),
    (dict(policy="frequency", stats={0: [1, 2, 3], 1: [1, 2, 3, 4]}), r"layer 0 counts 3 experts but this "
                                                                     r"qwen3_moe model has 4"),
    (dict(policy="frequency", stats={0: [1, -2, 3, 4], 1: [1, 2, 3, 4]}), r"layer 0 has count -2"),
    (dict(policy="frequency", stats=STATS, offload_params=["experts"]), r"--offload-params and --policy frequency"),
])
def test_user_errors(kwargs, message):
    with pytest.raises(SelectorError, match=message):
        plan(INV, offload_gb=gb(1000), **kwargs)


def test_a_dense_model_has_nothing_to_place_by_frequency():
    with pytest.raises(SelectorError, match="has none: use sparse-first"):
        plan(make_inv(dense_layer(0), experts=None, top_k=None), offload_gb=gb(10), policy="frequency",
             stats={0: [1]})
