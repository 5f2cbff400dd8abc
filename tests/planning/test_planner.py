"""The planner on hand-built inventories: every tier asserted, every byte count derived by hand.

The toy model (one MoE layer of 1120 B: experts 768 B, dense 352 B; embedding, final norm, LM head) and its
byte counts are in fixtures_records.py.
"""

from __future__ import annotations

import json
import random

import pytest

from moe_offload.errors import BudgetError, MoeOffloadError, SelectorError
from moe_offload.model.inventory import component_of
from moe_offload.planning.planner import matches_selector, plan
from moe_offload.planning.placement import GiB, Plan, Tier
from moe_offload.model.roles import Role

from fixtures_records import EMBED, FINAL_NORM, LM_HEAD, dense_layer, expert_names, full_model, gb, host, layer, make_inv, with_buffer

# ---------------------------------------------------------------------------------------
# Sparse-first ordering


def test_experts_go_before_attention_router_and_norm_inside_a_layer():
    inv = make_inv(layer(0))   # dense declared first: norm, attention, router, then experts
    p = plan(inv, offload_gb=gb(768))   # exactly the experts: 512 + 256
    assert host(p) == expert_names([0])
    assert p.offloaded_bytes == 768 and p.resident_bytes == 352 and p.budget_bytes == 768

    p = plan(inv, offload_gb=gb(512))   # gate_up_proj alone meets it
    assert host(p) == ["model.layers.0.mlp.experts.gate_up_proj"]

    p = plan(inv, offload_gb=gb(513))   # one byte more needs down_proj too; still no dense tensor
    assert host(p) == expert_names([0])

    p = plan(inv, offload_gb=gb(768 + 1))   # past the experts: the first declared dense tensor (16 B norm)
    assert host(p) == ["model.layers.0.input_layernorm.weight", *expert_names([0])]


@pytest.mark.parametrize("order", ["declared", "reversed", "shuffled"])
def test_global_budget_of_all_experts_offloads_every_layers_experts_and_no_dense(order):
    specs = [s for i in range(6) for s in layer(i)]
    if order == "reversed":
        specs.reverse()
    elif order == "shuffled":
        random.Random(7).shuffle(specs)
    inv = make_inv(specs)
    p = plan(inv, offload_gb=gb(6 * 768))   # 4608 B: the experts of all six layers
    assert sorted(host(p)) == sorted(expert_names(range(6)))
    assert p.offloaded_bytes == 4608
    assert all(t.tier == "device" for t in p.tensors if t.role != "routed_expert")
    assert not any("dense" in n for n in p.notes)


def test_large_batch_where_expert_density_rounds_to_one_still_offloads_experts_first():
    # At batch 64, 1 - (1/2)^64 == 1.0 in float64: the experts tie with dense tensors, and the
    # dense tensors declared first must not win the tie.
    inv = make_inv(layer(0) + layer(1))
    p = plan(inv, offload_gb=gb(2 * 768), batch=64)
    assert host(p) == expert_names([0, 1])
    assert not any(n.startswith("dense tensors offloaded") for n in p.notes)


@pytest.mark.parametrize("prefix", ["model.visual", "model.vision_tower"])
def test_vision_tower_declared_first_stays_resident_below_the_experts(prefix):
    tower = [
        (f"{prefix}.patch_embed.proj.weight", (8, 12)),        # 192 B
        (f"{prefix}.blocks.0.norm1.weight", (8,)),              # 16 B
        (f"{prefix}.blocks.0.attn.qkv.weight", (24, 8)),        # 384 B
        (f"{prefix}.blocks.0.mlp.fc1.weight", (32, 8)),         # 512 B
    ]                                                           # tower: 1104 B = 1.08 KiB
    inv = make_inv(tower + layer(0) + layer(1))                 # experts: 2 x 768 = 1536 B
    assert {component_of(n) for n, _ in tower} == {"vision"}

    p = plan(inv, offload_gb=gb(1000))
    # gate_up_proj of layer 0 (512 B), down_proj (256 B), then 232 B are left: the smallest expert tensor
    # covering them is layer 1's down_proj (256 B): 1024 >= 1000
    assert host(p) == ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj",
                       "model.layers.1.mlp.experts.down_proj"]
    assert all(t.tier == "device" for t in p.tensors if t.component == "vision")
    assert "the vision tower (1.08 KiB) stays resident: the budget was met before its turn" in p.notes
    assert not any(n.startswith("dense tensors offloaded") for n in p.notes)

    # The legacy declaration order offloads the tower first: the reported bug, reproduced on purpose.
    legacy = plan(inv, offload_gb=gb(1000), policy="declaration")
    assert host(legacy) == [n for n, _ in tower]   # 192 + 16 + 384 + 512 = 1104 >= 1000
    assert not any("stays resident" in n for n in legacy.notes)


def test_tower_not_selected_by_offload_params_is_said_so():
    tower = [("model.visual.blocks.0.mlp.fc1.weight", (32, 8))]   # 512 B
    p = plan(make_inv(tower + layer(0)), offload_gb=gb(256), offload_params=["experts"])
    assert host(p) == ["model.layers.0.mlp.experts.gate_up_proj"]
    assert "the vision tower (512 B) stays resident: --offload-params selects none of it" in p.notes


def test_untied_input_embedding_goes_before_experts():
    inv = full_model()
    p = plan(inv, offload_gb=gb(256))   # the embedding alone: density 1/16 < 1/2
    assert host(p) == ["model.embed_tokens.weight"]
    assert p.tensors[0].role == "embedding"

    # One byte more: an expert tensor must go too, and the smallest that covers that byte is the cheapest
    # (every expert tensor has density 1/2): down_proj (256 B), not gate_up_proj (512 B).
    p = plan(inv, offload_gb=gb(257))
    assert host(p) == ["model.embed_tokens.weight", "model.layers.0.mlp.experts.down_proj"]


def test_tied_embedding_is_the_lm_head_and_waits_for_the_experts():
    inv = full_model(tied=True)
    roles = {t.name: t.role for t in plan(inv).tensors}
    assert roles["model.embed_tokens.weight"] == "lm_head"
    assert "lm_head.weight" not in roles

    p = plan(inv, offload_gb=gb(256))
    assert host(p) == ["model.layers.0.mlp.experts.down_proj"]   # 256 B covers it exactly; the table stays
    p = plan(inv, offload_gb=gb(768 + 1))   # experts, then dense in declaration order: the tied table first
    assert host(p) == ["model.embed_tokens.weight", *expert_names([0])]


# ---------------------------------------------------------------------------------------
# Spill-over and the legacy order


def test_budget_above_the_experts_spills_dense_in_declaration_order_and_says_so():
    inv = make_inv(layer(0) + layer(1))   # experts 1536 B; dense per layer: 16, 128, 128, 16, 64
    p = plan(inv, offload_gb=gb(1536 + 100))
    # dense in declaration order: layer 0 input_layernorm 16 B, q_proj 128 B -> 144 >= 100
    assert host(p) == ["model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_proj.weight",
                       *expert_names([0, 1])]
    assert p.offloaded_bytes == 1536 + 144
    assert ("dense tensors offloaded: the 1.60 KiB budget exceeds the 1.50 KiB of routed experts and lookup "
            "tables (1.50 KiB routed experts in all), so 2 dense tensors (144 B) were offloaded in declaration "
            "order; every token reads them in full") in p.notes   # 1636 B = 1.60 KiB, 1536 B = 1.50 KiB


@pytest.mark.parametrize("budget", [1, 512, 1000, 1535, 1536])
def test_no_dense_note_when_the_budget_is_within_the_experts(budget):
    p = plan(make_inv(layer(0) + layer(1)), offload_gb=gb(budget))
    assert all(t.role == "routed_expert" for t in p.tensors if t.tier == "host")
    assert not any("dense" in n for n in p.notes)


def test_declaration_policy_offloads_in_declaration_order():
    inv = make_inv(layer(0))
    p = plan(inv, offload_gb=gb(200), policy="declaration")
    # input_layernorm 16 + q_proj 128 + o_proj 128 = 272 >= 200
    assert host(p) == ["model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_proj.weight",
                       "model.layers.0.self_attn.o_proj.weight"]
    assert p.policy == "declaration"
    assert ("3 dense tensors (272 B) offloaded by declaration order; every decoded token reads them in full over "
            "the link (sparse-first would offload routed experts first)") in p.notes
    assert "offloaded 72 bytes more than the budget: tensors move whole, and the last one " \
           "(model.layers.0.self_attn.o_proj.weight, 128 bytes) crossed the target" in p.notes


# ---------------------------------------------------------------------------------------
# Explicit selectors


@pytest.mark.parametrize("selector, expected", [
    ("experts", True),
    ("expert", False),
    ("experts.down_proj", True),
    ("mlp.experts", True),
    ("layers.3", True),
    ("layers.3.experts", False),   # segments must be contiguous
    ("down", False),
    ("model.layers.3.mlp.experts.down_proj", True),
])
def test_selectors_match_whole_segment_sequences(selector, expected):
    assert matches_selector("model.layers.3.mlp.experts.down_proj", selector) is expected


def test_multi_segment_selector_picks_only_down_proj():
    inv = make_inv(layer(0) + layer(1))
    p = plan(inv, offload_gb=gb(512), offload_params=["experts.down_proj"])   # 2 x 256 B
    assert host(p) == ["model.layers.0.mlp.experts.down_proj", "model.layers.1.mlp.experts.down_proj"]
    assert p.policy == "explicit" and p.offload_params == ("experts.down_proj",)
    reasons = {t.name: t.reason for t in p.tensors}
    assert reasons["model.layers.0.mlp.experts.gate_up_proj"] == "resident: not selected by --offload-params"


def test_selected_tensors_go_in_declaration_order_and_the_budget_still_applies():
    inv = make_inv(layer(0) + layer(1))
    # Attention is declared before the experts: explicit selection does not reorder by density.
    p = plan(inv, offload_gb=gb(256), offload_params=["self_attn", "experts"])
    assert host(p) == ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"]
    p = plan(inv, offload_gb=gb(600), offload_params=["experts"])   # 512 + 256 >= 600; layer 1 stays
    assert host(p) == expert_names([0])
    p = plan(inv, offload_params=["experts"])   # no budget: selection alone offloads nothing
    assert host(p) == []


def test_selector_matching_nothing_names_similar_segments():
    inv = make_inv(layer(0))
    with pytest.raises(SelectorError) as err:
        plan(inv, offload_gb=gb(100), offload_params=["experts", "expert"])
    msg = str(err.value)
    assert "'expert'" in msg and "matches no tensor" in msg and "similar segments: experts" in msg


def test_budget_above_the_selected_bytes_is_an_error():
    inv = make_inv(layer(0) + layer(1))
    plan(inv, offload_gb=gb(512), offload_params=["experts.down_proj"])   # exactly the selection: fine
    with pytest.raises(BudgetError, match=r"more than the tensors offload_params selects \(512 B, 512 bytes\)"):
        plan(inv, offload_gb=gb(513), offload_params=["experts.down_proj"])


# ---------------------------------------------------------------------------------------
# Dense models


@pytest.mark.parametrize("budget", [0, 1, 256, 257, 400, 700, 1000, 256 + 2 * 656 + 16 + 256])
def test_dense_model_sparse_first_equals_declaration_order(budget):
    inv = make_inv([EMBED, *dense_layer(0), *dense_layer(1), FINAL_NORM, LM_HEAD], experts=None, top_k=None,
                   model_type="qwen3")   # 256 + 1312 + 16 + 256 = 1840 B
    sparse = plan(inv, offload_gb=gb(budget))
    legacy = plan(inv, offload_gb=gb(budget), policy="declaration")
    assert sparse.tiers == legacy.tiers
    assert sparse.offloaded_bytes == legacy.offloaded_bytes >= budget
    assert sparse.roles()["routed_expert"]["bytes"] == 0


def test_dense_model_exact_tiers():
    inv = make_inv([EMBED, *dense_layer(0), FINAL_NORM, LM_HEAD], experts=None, top_k=None, model_type="qwen3")
    p = plan(inv, offload_gb=gb(256 + 16 + 1))   # embedding 256, input_layernorm 16, q_proj 128
    assert host(p) == ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
                       "model.layers.0.self_attn.q_proj.weight"]


# ---------------------------------------------------------------------------------------
# Device memory


def test_device_memory_that_fits_offloads_nothing_and_says_so():
    p = plan(full_model(), device_memory_gb=3)   # 1648 B + 2 GiB default reserve <= 3 GiB
    assert host(p) == [] and p.budget_bytes == 0
    assert "the model fits: 1.61 KiB of weights + 2 GiB reserve <= 3 GiB of device memory; nothing offloaded" \
        in p.notes   # 1648 B = 1.609 KiB
    p = plan(full_model(), device_memory_gb=gb(1648 + 1024), reserve_gb=gb(1024))   # fits to the byte
    assert host(p) == [] and p.budget_bytes == 0


def test_device_memory_offloads_the_least_that_fits():
    reserve = 1024
    # room for 1348 B of weights: 1648 - 1348 = 300 B must go
    p = plan(full_model(), device_memory_gb=gb(1348 + reserve), reserve_gb=gb(reserve))
    assert p.budget_bytes == 300
    # embedding 256 < 300, then 44 B more: one expert of down_proj (4 experts of 64 B; gate_up_proj's are
    # 128 B): resident 1648 - 320 = 1328 <= 1348
    assert host(p) == ["model.embed_tokens.weight", "model.layers.0.mlp.experts.down_proj"]
    split = {t.name: t.host_experts for t in p.tensors if t.host_experts}
    assert split == {"model.layers.0.mlp.experts.down_proj": 1}
    assert p.offloaded_bytes == 320 and p.resident_bytes == 1328 <= 1348

    p = plan(full_model(), device_memory_gb=gb(1392 + reserve), reserve_gb=gb(reserve))   # 256 B must go
    assert host(p) == ["model.embed_tokens.weight"] and p.resident_bytes == 1392

    p = plan(full_model(), device_memory_gb=gb(1391 + reserve), reserve_gb=gb(reserve))   # one byte less room
    assert host(p) == ["model.embed_tokens.weight", "model.layers.0.mlp.experts.down_proj"]
    assert p.offloaded_bytes == 256 + 64   # the embedding and one 64 B expert of down_proj


def test_device_memory_that_cannot_fit_even_with_everything_eligible_offloaded():
    # Only the down_proj (256 B) may go: 1648 - 256 = 1392 B stay, more than 1000 B of room.
    with pytest.raises(BudgetError, match="cannot fit"):
        plan(full_model(), device_memory_gb=gb(1000 + 1024), reserve_gb=gb(1024),
             offload_params=["experts.down_proj"])
    p = plan(full_model(), device_memory_gb=gb(1392 + 1024), reserve_gb=gb(1024),
             offload_params=["experts.down_proj"])
    assert host(p) == ["model.layers.0.mlp.experts.down_proj"]


@pytest.mark.parametrize("kwargs", [
    dict(device_memory_gb=1, reserve_gb=2),          # reserve larger than the device
    dict(device_memory_gb=1),                        # the 2 GiB default reserve, likewise
    dict(offload_gb=-1),
    dict(offload_gb=-gb(1)),
    dict(device_memory_gb=-1),
    dict(device_memory_gb=4, reserve_gb=-1),
    dict(offload_gb=float("nan")),
    dict(offload_gb=float("inf")),
    dict(offload_gb=gb(1), device_memory_gb=4),      # two budgets
    dict(reserve_gb=1),                              # reserve without device memory
    dict(offload_gb=gb(1649)),                       # more than the whole model (1648 B)
    dict(offload_gb=gb(1), batch=0),
])
def test_bad_budgets_are_budget_errors(kwargs):
    with pytest.raises(BudgetError):
        plan(full_model(), **kwargs)


def test_unknown_policies_are_user_errors():
    with pytest.raises(SelectorError, match="unknown policy 'fastest'"):
        plan(full_model(), offload_gb=gb(1), policy="fastest")
    with pytest.raises(SelectorError, match="set by offload_params"):
        plan(full_model(), offload_gb=gb(1), policy="explicit")


def test_zero_budget_offloads_nothing_and_no_budget_says_so():
    p = plan(full_model(), offload_gb=0)
    assert host(p) == [] and p.budget_bytes == 0 and p.notes == ()
    p = plan(full_model())
    assert host(p) == []
    assert p.notes == ("no budget given (--offload-gb or --device-memory): everything stays on the device",)


def test_whole_model_budget_offloads_everything():
    p = plan(full_model(), offload_gb=gb(1648))
    assert p.resident_bytes == 0 and p.offloaded_bytes == 1648


# ---------------------------------------------------------------------------------------
# Overshoot bound


# The order each policy offloads in, for full_model(2), written out by hand.
_DENSE_2 = ["model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.o_proj.weight", "model.layers.0.post_attention_layernorm.weight",
            "model.layers.0.mlp.gate.weight",
            "model.layers.1.input_layernorm.weight", "model.layers.1.self_attn.q_proj.weight",
            "model.layers.1.self_attn.o_proj.weight", "model.layers.1.post_attention_layernorm.weight",
            "model.layers.1.mlp.gate.weight", "model.norm.weight", "lm_head.weight"]
ORDER = {
    "sparse-first": ["model.embed_tokens.weight", *expert_names([0, 1]), *_DENSE_2],
    "declaration": [r.name for r in full_model(2).records],
}


@pytest.mark.parametrize("policy", ["sparse-first", "declaration"])
def test_overshoot_is_less_than_the_last_tensor_offloaded(policy):
    inv = full_model(2)   # 256 + 2 x 1120 + 16 + 256 = 2768 B
    size = {r.name: r.bytes for r in inv.records}
    assert sum(size.values()) == 2768 and sorted(ORDER[policy]) == sorted(size)
    rng = random.Random(1234)
    for budget in [0, 1, 2767, 2768] + [rng.randrange(0, 2769) for _ in range(200)]:
        p = plan(inv, offload_gb=gb(budget), policy=policy)
        # The shortest prefix of the order that reaches the budget, except that under sparse-first the
        # budget is finished by expert slices (4 experts per tensor): the last n experts of the remaining
        # expert tensor with the smallest slice that covers what is left. Embedding and dense: whole, in order.
        expected, done, rest, split = [], 0, list(ORDER[policy]), {}
        while done < budget:
            name = rest[0]
            need = budget - done
            if policy == "sparse-first" and ".experts." in name and size[name] >= need:
                name = min((n for n in rest if ".experts." in n and size[n] >= need), key=lambda n: size[n] // 4)
                n = -(-need // (size[name] // 4))
                if n < 4:
                    split[name] = n
                    expected.append(name)
                    done += n * (size[name] // 4)
                    break
            rest.remove(name)
            expected.append(name)
            done += size[name]
        assert sorted(host(p)) == sorted(expected)
        # every offloaded expert tensor lists its experts off the device: the last n of a split, all 4 of a whole
        assert {t.name: t.host_experts for t in p.tensors if t.host_experts} == \
            {n: split.get(n, 4) for n in expected if ".experts." in n}
        assert all(t.host_expert_ids == tuple(range(4 - t.host_experts, 4)) for t in p.tensors if t.host_experts)
        over = p.offloaded_bytes - budget
        assert p.budget_bytes == budget and over >= 0
        overshoot_notes = [n for n in p.notes if "more than the budget" in n]
        last = expected[-1] if expected else None
        if over and last in split:
            assert over < size[last] // 4   # below one expert slice
            assert overshoot_notes == [f"offloaded {over} bytes more than the budget: {last} went in part (its "
                                       f"last {split[last]} of 4 experts, {size[last] // 4} bytes each), and the "
                                       "last expert crossed the target"]
        elif over:
            assert over < size[last]
            assert overshoot_notes == [f"offloaded {over} bytes more than the budget: tensors move whole, and the "
                                       f"last one ({last}, {size[last]} bytes) crossed the target"]
        else:
            assert overshoot_notes == []


# ---------------------------------------------------------------------------------------
# Link bytes and parameter counts


def test_link_bytes_per_token_by_hand():
    inv = full_model()   # embed 256 B (16 rows), experts 768 B (E=4, k=2), dense 1648 - 1024 = 624 B
    everything = plan(inv, offload_gb=gb(1648))
    # b=1: 256 x 1/16 + 768 x 1/2 + 624 = 16 + 384 + 624 = 1024
    assert everything.link_bytes_per_token() == pytest.approx(1024)
    # b=4: (256 x 4/16 + 768 x 15/16 + 624) / 4 = (64 + 720 + 624) / 4 = 352
    assert everything.link_bytes_per_token(4) == pytest.approx(352)
    # b=32 > 16 rows: the embedding is read whole once: (256 + 768 x (1 - 2^-32) + 624) / 32 ~= 51.5
    assert everything.link_bytes_per_token(32) == pytest.approx((256 + 768 * (1 - 0.5 ** 32) + 624) / 32)

    at4 = plan(inv, offload_gb=gb(1648), batch=4)
    assert at4.link_bytes_per_token() == pytest.approx(352)
    assert at4.to_dict()["link_bytes_per_token"] == pytest.approx(352)

    experts_only = plan(inv, offload_gb=gb(1024), batch=4)   # embedding + experts
    assert host(experts_only) == ["model.embed_tokens.weight", *expert_names([0])]
    assert experts_only.link_bytes_per_token() == pytest.approx((64 + 720) / 4)   # 196
    assert experts_only.link_bytes_per_token(1) == pytest.approx(16 + 384)        # 400

    assert plan(inv, offload_gb=0).link_bytes_per_token() == 0


def test_density_of_planned_tensors():
    t = {x.name: x for x in plan(full_model(), offload_gb=0).tensors}
    assert t["model.layers.0.mlp.experts.down_proj"].density(1) == 0.5
    assert t["model.layers.0.mlp.experts.down_proj"].density(4) == 15 / 16
    assert t["model.embed_tokens.weight"].density(1) == 1 / 16
    assert t["model.embed_tokens.weight"].density(4) == 4 / 16
    assert t["model.layers.0.mlp.gate.weight"].density(4) == 1.0
    assert t["lm_head.weight"].density(1) == 1.0



def test_active_and_total_params_by_hand():
    p = plan(with_buffer())
    # params: embed 128, layer 8 + 64 + 64 + 8 + 32 + 256 + 128 = 560, norm 8, lm_head 128; the buffer is none
    assert p.total_params == 128 + 560 + 8 + 128 == 824
    # active: no embedding; experts (384) at k/E = 1/2; LM head in full: 824 - 128 - 192 = 504
    assert p.active_params == 504
    assert p.total_bytes == 1648 + 16

    tied = plan(full_model(tied=True))
    # the tied table is the LM head, read in full: 128 + 560 + 8 = 696 params, 696 - 192 = 504 active
    assert tied.total_params == 696 and tied.active_params == 504


# ---------------------------------------------------------------------------------------
# The plan as data


def test_plan_json_round_trip_and_views():
    p = plan(with_buffer(), offload_gb=gb(300))
    back = Plan.from_json(p.to_json())
    assert back == p
    assert Plan.from_json(p.to_json(indent=1)) == p
    assert p.tiers == {t.name: t.tier for t in p.tensors}
    # 300 B: the embedding (256 B), then the smallest expert tensor covering 44 B, down_proj (256 B)
    assert p.tiers["model.layers.0.mlp.experts.down_proj"] == Tier.HOST.value == "host"
    assert p.tiers["model.layers.0.mlp.experts.gate_up_proj"] == "device"
    assert p.tiers["lm_head.weight"] == "device"
    assert set(p.tiers.values()) <= {"device", "host", "disk"}

    data = json.loads(p.to_json())
    for key in ("total_params", "active_params", "total_bytes", "offloaded_bytes", "resident_bytes",
                "budget_bytes", "link_bytes_per_token", "roles", "tensors", "notes"):
        assert key in data
    assert [t["name"] for t in data["tensors"]] == [r.name for r in with_buffer().records]


def test_roles_partition_the_model():
    p = plan(with_buffer(), offload_gb=gb(300))
    roles = p.roles()
    assert set(roles) == {r.value for r in Role}
    assert all(t.role in roles for t in p.tensors)   # exactly one role per tensor, a known one
    assert sum(r["bytes"] for r in roles.values()) == p.total_bytes == 1664
    assert sum(r["params"] for r in roles.values()) == p.total_params == 824
    # 300 B: embedding 256 B + one expert (64 B) of down_proj
    assert sum(r["offloaded_bytes"] for r in roles.values()) == p.offloaded_bytes == 320
    assert roles["routed_expert"] == {"params": 384, "bytes": 768, "offloaded_bytes": 64}
    assert roles["embedding"] == {"params": 128, "bytes": 256, "offloaded_bytes": 256}
    assert roles["lm_head"] == {"params": 128, "bytes": 256, "offloaded_bytes": 0}
    # router: gate.weight 32 params / 64 B + the buffer 0 params / 16 B
    assert roles["router"] == {"params": 32, "bytes": 80, "offloaded_bytes": 0}
    assert roles["shared_expert"] == {"params": 0, "bytes": 0, "offloaded_bytes": 0}
    assert roles["norm"] == {"params": 24, "bytes": 48, "offloaded_bytes": 0}
    assert roles["attention"] == {"params": 128, "bytes": 256, "offloaded_bytes": 0}


def _tamper(text: str, fn) -> str:
    data = json.loads(text)
    fn(data)
    return json.dumps(data)


@pytest.mark.parametrize("bad", [
    "",
    "{not json",
    "[]",
    "null",
    '{"tensors": []}',
    "TAMPER:no_tensors",
    "TAMPER:missing_field",
    "TAMPER:extra_field",
    "TAMPER:bad_tier",
    "TAMPER:shape_not_list",
])
def test_malformed_plan_json_is_a_user_error(bad):
    good = plan(full_model(), offload_gb=gb(300)).to_json()
    tampering = {
        "no_tensors": lambda d: d.pop("tensors"),
        "missing_field": lambda d: d["tensors"][0].pop("tier"),
        "extra_field": lambda d: d["tensors"][0].update(colour="red"),
        "bad_tier": lambda d: d["tensors"][0].update(tier="gpu"),
        "shape_not_list": lambda d: d["tensors"][0].update(shape=7),
    }
    if bad.startswith("TAMPER:"):
        bad = _tamper(good, tampering[bad.removeprefix("TAMPER:")])
    with pytest.raises(MoeOffloadError, match="not a moe-offload plan"):
        Plan.from_json(bad)


# ---------------------------------------------------------------------------------------
# API gaps (issue 7): string selectors, Python argument names, quantized configs without a dtype


def test_a_string_selector_is_one_selector():
    inv = make_inv(layer(0) + layer(1))
    as_str = plan(inv, offload_gb=gb(512), offload_params="experts")
    as_list = plan(inv, offload_gb=gb(512), offload_params=["experts"])
    # Declaration order among the selected: layer 0's gate_up_proj (512 B) meets the budget alone.
    assert host(as_str) == host(as_list) == ["model.layers.0.mlp.experts.gate_up_proj"]
    assert as_str.offload_params == ("experts",) and as_str.offloaded_bytes == 512


def test_a_string_selector_through_the_python_api(family_dir):
    import moe_offload as mo

    folder = family_dir("qwen3_moe")
    p = mo.plan(folder, offload_gb=gb(1), offload_params="down_proj")
    assert p.offload_params == ("down_proj",)
    # conftest's tiny qwen3_moe (float32): one down_proj [4 experts, 32, 16] = 8192 B covers 1 B of budget.
    assert host(p) == ["model.layers.0.mlp.experts.down_proj"] and p.offloaded_bytes == 8192


@pytest.mark.parametrize("kwargs, python, flag", [
    (dict(offload_gb=-1), "offload_gb=-1 is not a size", "--offload-gb -1 is not a size"),
    (dict(device_memory_gb=-1), "device_memory_gb=-1 is not a size", "--device-memory -1 is not a size"),
    (dict(offload_gb=gb(1), device_memory_gb=4), "offload_gb and device_memory_gb both set a budget",
     "--offload-gb and --device-memory both set a budget"),
    (dict(reserve_gb=1), "reserve_gb only applies with device_memory_gb", "--reserve-gb only applies with "
     "--device-memory"),
    (dict(offload_gb=gb(1649)), "offload_gb=1.53575e-06 is more than the whole model (1.61 KiB, 1648 bytes)",
     "--offload-gb 1.53575e-06 is more than the whole model"),
    (dict(device_memory_gb=1, reserve_gb=2), "device_memory_gb=1 GiB is less than the 2 GiB reserve: lower "
     "reserve_gb", "--device-memory 1 GiB is less than the 2 GiB reserve: lower --reserve-gb"),
    (dict(offload_gb=gb(1), offload_params="nothing"), "offload_params 'nothing' matches no tensor",
     "--offload-params 'nothing' matches no tensor"),
    (dict(offload_gb=gb(1), batch=0), "batch=0: the number of sequences", "--batch 0: the number of sequences"),
])
def test_python_errors_name_arguments_and_the_cli_shows_flags(kwargs, python, flag):
    from moe_offload.cli.main import _as_flags

    with pytest.raises(MoeOffloadError) as err:
        plan(full_model(), **kwargs)
    message = str(err.value)
    assert python in message and "--" not in message, message
    assert flag in _as_flags(message)


def test_cli_budget_errors_still_name_flags(family_dir, capsys):
    from moe_offload.cli import main as cli

    rc = cli.main(["plan", str(family_dir("qwen3_moe")), "--offload-gb", "-1"])
    err = capsys.readouterr().err
    assert rc == 2 and err == "error: --offload-gb -1.0 is not a size: give a non-negative number of GiB\n"


def test_gpt_oss_120b_without_dtype_plans_as_its_published_checkpoint(write_config):
    """Quantized config without torch_dtype/dtype: unquantized tensors planned as bf16, with a note.

    gpt-oss-120b (published.GPT_OSS_120B, 36 layers, 128 experts, hidden 2880):
      MXFP4 experts, 17/32 byte per element: 36 x 128 x 2880 x (5760 + 2880) x 17/32 = 60,914,073,600 B
      bf16 rest, 2,167,371,072 params x 2 B                                        =  4,334,742,144 B
        (embed + lm_head 2 x 201088 x 2880 = 1,158,266,880; per layer 28,030,592: attention 26,550,144,
         router 368,768, norms 5,760, expert biases 1,105,920; final norm 2,880)
      total 65,248,815,744 B = 60.77 GiB against the published checkpoint's 60.8 GiB (float32 rest: 64.8 GiB).
    """
    import moe_offload as mo
    from moe_offload.model.published import GPT_OSS_120B

    without = {k: v for k, v in GPT_OSS_120B.items() if k != "dtype"}
    p = mo.plan(write_config(without, name="no-dtype"))
    assert p.total_bytes == 65_248_815_744
    assert abs(p.total_bytes - 60.8 * GiB) < 0.01 * 60.8 * GiB
    assert {t.dtype for t in p.tensors} == {"mxfp4", "bfloat16"}
    assert any("names no dtype" in n and "mxfp4" in n and "bfloat16" in n for n in p.notes)
    # The same bytes as the config that names bf16 itself, which needs no note.
    named = mo.plan(write_config(GPT_OSS_120B, name="bf16"))
    assert named.total_bytes == p.total_bytes and not any("names no dtype" in n for n in named.notes)


def test_fp8_block_config_without_dtype_plans_its_unquantized_tensors_as_bf16(write_config):
    """One-layer tiny qwen3_moe (conftest) with an FP8 128x128 block quantization_config and no dtype.

      fp8 Linear weights + one 4 B scale per 128x128 block: q 32x32 -> 1028, k 16x32 -> 516, v 516, o 1028
      fp8 experts: gate_up [4, 32, 32] 4096 + 4 x 2 halves x 4 B = 4128; down [4, 32, 16] 2048 + 16 = 2064
      bf16: embed 64x32 4096, lm_head 4096 (not converted), router 4x32 256, q/k norms 2 x 16, norms 3 x 64
      total 17,952 B (read as float32 the bf16 part would double: 26,624 B)
    """
    import moe_offload as mo

    from conftest import tiny_config_dict

    config = tiny_config_dict("qwen3_moe", num_hidden_layers=1)
    config.pop("dtype", None)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    p = mo.plan(write_config(config))
    assert p.total_bytes == 17_952
    by_name = {t.name: t for t in p.tensors}
    assert by_name["lm_head.weight"].dtype == "bfloat16" and by_name["lm_head.weight"].bytes == 4096
    assert by_name["model.layers.0.mlp.gate.weight"].bytes == 256
    assert {t.dtype for t in p.tensors} == {"float8_e4m3fn", "bfloat16"}
    assert any("names no dtype" in n and "fp8" in n for n in p.notes)


def test_a_plan_for_another_model_is_a_plan_mismatch_error(save_tiny):
    import moe_offload as mo
    from moe_offload.errors import PlanMismatchError

    small = save_tiny("qwen3_moe", name="one-layer", num_hidden_layers=1)
    other = save_tiny("qwen3_moe", name="two-layers")
    with pytest.raises(PlanMismatchError, match="the plan is for another model"):
        mo.load(other, device="cpu", plan=mo.plan(small))
    # Same names, another dtype: bf16 weights against a plan made for the float32 checkpoint.
    with pytest.raises(PlanMismatchError, match="shape .* float32, but .* loads it as .* bfloat16"):
        mo.load(small, device="cpu", dtype="bf16", plan=mo.plan(small))
    assert mo.PlanMismatchError is PlanMismatchError and issubclass(PlanMismatchError, MoeOffloadError)
