"""accounting.TokenBytes: the bytes one decoded token reads per tier, counted by hand on the planner's toy model.

Toy model (tests/test_planner.py, bfloat16, E=4, top-k 2), two layers:
    per layer: dense 352 B (norms 16 + 16, q 128, o 128, router 64);
               experts gate_up_proj 512 B (128 B per expert) + down_proj 256 B (64 B per expert)
               = 192 B per expert
    around: embed_tokens (16, 8) 256 B (one row: 16 B), norm 16 B, lm_head 256 B
    whole model: 256 + 2 x 1120 + 16 + 256 = 2768 B
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from moe_offload.planning.accounting import TokenBytes
from moe_offload.planning.planner import plan
from fixtures_records import EMBED, FINAL_NORM, LM_HEAD, gb, layer, make_inv

INV = make_inv([EMBED, *layer(0), *layer(1), FINAL_NORM, LM_HEAD])
DENSE = 2 * 352 + 16 + 256    # 976 B: every dense tensor, read in full by each decoded token
ROW = 16                       # one embedding row


def test_everything_offloaded_by_hand():
    tb = plan(INV, offload_gb=gb(2768)).token_bytes()
    assert tb.layers == (0, 1) and tb.num_experts == 4 and tb.top_k == 2
    assert tb.dense_host == DENSE + ROW and tb.dense_disk == 0
    assert tb.expert_bytes(0) == ((192, 192, 192, 192), (0, 0, 0, 0))
    # picks (0, 1) in layer 0 and (3,) in layer 1: 992 + 2 x 192 + 192
    assert tb.bytes_for_token([(0, 1), (3,)]) == (992 + 576, 0)
    assert tb.bytes_for_token({1: [3], 0: [1, 0]}) == (1568, 0)
    assert tb.bytes_for_token([(), ()]) == (992, 0)


def test_nothing_offloaded_reads_nothing():
    tb = plan(INV, offload_gb=0).token_bytes()
    assert tb.bytes_for_token([(0, 1), (2, 3)]) == (0, 0) and tb.expected() == (0.0, 0.0)


def test_a_split_tensor_counts_only_its_host_experts():
    # sparse-first at 256 + 64 + 1 B: the embedding (256), then the smallest covering slice: the last 2 of
    # layer 0's down_proj experts (2 x 64 = 128 B) -> 384 B offloaded
    p = plan(INV, offload_gb=gb(256 + 65))
    split = [t for t in p.tensors if t.host_experts]
    assert [(t.name, t.host_ids) for t in split] == [("model.layers.0.mlp.experts.down_proj", (2, 3))]
    tb = p.token_bytes()
    assert tb.expert_bytes(0)[0] == (0, 0, 64, 64) and tb.expert_bytes(1)[0] == (0, 0, 0, 0)
    assert tb.bytes_for_token([(1, 3), (0, 2)]) == (ROW + 64, 0)
    # expected: row 16 + 128 B x 1/2
    assert tb.expected() == (pytest.approx(16 + 64), 0.0)


def test_arbitrary_expert_subsets_and_the_disk_tier():
    p = plan(INV, offload_gb=gb(2768))
    tensors = []
    for t in p.tensors:
        if t.name == "model.layers.1.mlp.experts.gate_up_proj":
            t = replace(t, host_experts=2, host_expert_ids=(0, 2))            # 2 x 128 B on the host
        elif t.name == "model.layers.1.mlp.experts.down_proj":
            t = replace(t, tier="disk")                                     # all 4 x 64 B on disk
        elif t.name == "lm_head.weight":
            t = replace(t, tier="disk")                                     # 256 B on disk
        elif t.name == "model.layers.0.self_attn.q_proj.weight":
            t = replace(t, tier="device")                                   # 128 B resident
        tensors.append(t)
    tb = TokenBytes.of(tensors)
    assert tb.dense_host == DENSE - 256 - 128 + ROW and tb.dense_disk == 256
    assert tb.expert_bytes(1) == ((128, 0, 128, 0), (64, 64, 64, 64))
    # layer 0 picks (0, 3): 2 x 192 host; layer 1 picks (2, 3): 128 host (expert 2) + 2 x 64 disk
    assert tb.bytes_for_token([(0, 3), (2, 3)]) == (608 + 384 + 128, 256 + 128)


def test_towers_and_buffers_of_other_components_are_not_read_when_decoding():
    inv = make_inv([("model.visual.blocks.0.attn.qkv.weight", (24, 8)), *layer(0)])   # 384 B vision tower
    tb = plan(inv, offload_gb=gb(384 + 1120)).token_bytes()
    assert tb.dense_host == 352 and tb.bytes_for_token([(0,)]) == (352 + 192, 0)


def test_uniform_expectation_is_the_mean_over_all_equally_likely_routings():
    # Uniform top-2 of 4: the 6 pairs equally likely, in each layer independently. The mean of the exact
    # per-token count over the 36 routings must be the expectation with k/E = 1/2.
    for budget in (0, 256 + 65, 700, 1600, 2768):
        tb = plan(INV, offload_gb=gb(budget)).token_bytes()
        pairs = list(itertools.combinations(range(4), 2))
        counts = [tb.bytes_for_token([a, b])[0] for a in pairs for b in pairs]
        assert tb.expected()[0] == pytest.approx(sum(counts) / len(counts)), budget


def test_frequency_expectation_is_the_mean_over_a_weighted_routing():
    # A routing distribution: layer 0 picks (0, 1) 3 times out of 4 and (2, 3) once; layer 1 always (1, 2).
    # Pick probabilities: layer 0 (3/4, 3/4, 1/4, 1/4), layer 1 (0, 1, 1, 0).
    tb = plan(INV, offload_gb=gb(2768)).token_bytes()
    routings = [([0, 1], [1, 2])] * 3 + [([2, 3], [1, 2])]
    mean = sum(tb.bytes_for_token(r)[0] for r in routings) / 4   # 992 + 384 + 384
    freq = {0: [0.75, 0.75, 0.25, 0.25], 1: [0.0, 1.0, 1.0, 0.0]}
    assert tb.expected(frequencies=freq) == (pytest.approx(mean), 0.0) and mean == 1760
    # At batch 2, a step reads an expert when either token picks it (1 - (1 - p)^2), shared by 2 tokens:
    # layer 0: 192 x 2 x (15/16 + 7/16) = 528; layer 1: 384; rows: 2 x 16; dense 976 -> (528 + 384 + 32 + 976) / 2
    assert tb.expected(2, freq) == (pytest.approx(960.0), 0.0)


def test_plan_link_bytes_use_the_accounting():
    p = plan(INV, offload_gb=gb(2768))
    assert p.link_bytes_per_token() == pytest.approx(DENSE + ROW + 2 * 768 / 2)         # 1760
    # batch 4: every expert read with 1 - (1/2)^4 = 15/16; 4 embedding rows; the rest once per step
    assert p.link_bytes_per_token(4) == pytest.approx((DENSE + 4 * ROW + 2 * 768 * 15 / 16) / 4)
