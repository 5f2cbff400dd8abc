"""`replay`: the bytes the decode tokens of a trace read under a placement (and a cache), counted by hand.

Part 1 uses the planner's toy model (tests/test_planner.py: bfloat16, E=4, top-k 2, 192 B per expert,
embedding row 16 B). Part 2 runs the command on a config.json alone, the model of tests/test_cli_plan.py:
Qwen3-MoE float32, hidden 32, 2 layers, E=4, top-k 2: one expert = gate_up 4096 B + down 2048 B = 6144 B per
layer; embedding (128, 32) 16384 B, one row 128 B; all routed experts 2 x 4 x 6144 = 49152 B.
"""

from __future__ import annotations

import json
import re
import time

import numpy as np
import pytest

from moe_offload.errors import TraceError
from moe_offload.planning.planner import plan
from moe_offload.planning.placement import GiB
from moe_offload.routing.replay import access_keys, replay, replay_routing
from moe_offload.formats.traces import Trace, TraceHeader, TraceRow, routing_array, write_trace
from fixtures_records import EMBED, FINAL_NORM, LM_HEAD, gb, layer, make_inv
from fixtures_cli import REPLAY_ROWS, write_replay_files, QWEN3_CONFIG, run_cli as run

INV = make_inv([EMBED, *layer(0), *layer(1), FINAL_NORM, LM_HEAD])
STATS = {0: [10, 0, 5, 5], 1: [3, 3, 7, 7]}
HEADER = TraceHeader("qwen3_moe", 4, 2, (0, 1))
ROWS = (
    TraceRow(0, 0, "prefill", ((0, 1), (0, 1))),   # prefill: not replayed
    TraceRow(0, 1, "decode", ((1, 0), (2, 3))),
    TraceRow(0, 2, "decode", ((1, 2), (0,))),       # layer 1 dropped a pick
    TraceRow(0, 3, "decode", ((3, 0), (2, 1))),
)
TRACE = Trace(HEADER, ROWS, "hand.jsonl")


def frequency_plan():
    # embedding + 3 units (tests/test_planner_frequency.py): L0e1, L1e0, L1e1 on the host
    return plan(INV, offload_gb=gb(256 + 3 * 192), policy="frequency", stats=STATS)


def test_replay_equals_the_hand_count():
    r = replay(frequency_plan(), TRACE)
    # token 1: row 16 + L0e1 192            = 208
    # token 2: row 16 + L0e1 192 + L1e0 192 = 400
    # token 3: row 16 + L1e1 192            = 208      -> 816 B over 3 tokens, 4 expert reads
    assert (r.tokens, r.expert_reads, r.cache_hits, r.cache_misses) == (3, 4, 0, 4)
    assert r.link_bytes_per_token == 816 / 3 == r.host_link_bytes_per_token and r.disk_read_bytes_per_token == 0
    assert (r.policy, r.cache_policy, r.offloaded_bytes, r.cache_bytes) == ("frequency", None, 832, 0)


def test_replay_counts_dense_tensors_in_full():
    # Everything offloaded (2768 B): each token reads dense 976 + row 16 + 192 per pick (2 + 2, 2 + 1, 2 + 2 picks)
    r = replay(plan(INV, offload_gb=gb(2768)), TRACE)
    assert r.expert_reads == 11 and r.link_bytes_per_token == (3 * 992 + 11 * 192) / 3


class RecordingCache:
    """Holds every expert it has seen (unbounded): a hit is any key accessed before."""

    def __init__(self):
        self.seen, self.calls, self.steps = set(), [], 0

    def begin_step(self):
        self.steps += 1

    def access(self, key, nbytes):
        self.calls.append((key, nbytes))
        hit = key in self.seen
        self.seen.add(key)
        return hit


def test_cache_accesses_in_runtime_order_and_hits_read_nothing():
    p = frequency_plan()
    tb = p.token_bytes()
    ids = routing_array(TRACE.decode_rows, 2, 2)
    cache = RecordingCache()
    cost = replay_routing(tb, ids, cache=cache)
    # offloaded picks, by token, layer, ascending id: (0,1) | (0,1) (1,0) | (1,1); resident experts unseen
    assert cache.calls == [((0, 1), 192), ((0, 1), 192), ((1, 0), 192), ((1, 1), 192)]
    assert access_keys(tb, ids) == [k for k, _ in cache.calls]
    assert cache.steps == len(TRACE.decode_rows)   # one marked step per decoded token, as the runtime marks them
    # one hit (the second (0,1)): 3 rows + 3 misses x 192
    assert (cost.cache_hits, cost.expert_reads, cost.host_bytes) == (1, 3, 3 * 16 + 3 * 192)


def test_replay_checks_the_trace_against_the_plan():
    with pytest.raises(TraceError, match="hand.jsonl records 8 experts per layer but the qwen3_moe plan has 4"):
        replay(frequency_plan(), Trace(TraceHeader("x", 8, 2, (0, 1)), ROWS, "hand.jsonl"))
    with pytest.raises(TraceError, match=r"routes layers \[0, 1\] \(missing \[1\]\)"):
        replay(frequency_plan(), Trace(TraceHeader("x", 4, 2, (0,)), (), "hand.jsonl"))
    with pytest.raises(TraceError, match="holds no decode tokens"):
        replay(frequency_plan(), Trace(HEADER, ROWS[:1], "hand.jsonl"))


# --- the command -----------------------------------------------------------------------------------------

CONFIG = QWEN3_CONFIG
EXPERT = 6144
FIELDS = {"tokens": int, "link_bytes_per_token": float, "expert_reads": int, "cache_hits": int, "cache_misses": int,
          "policy": str, "cache_policy": (str, type(None)), "offloaded_bytes": int, "cache_bytes": int,
          "host_link_bytes_per_token": float, "disk_read_bytes_per_token": float}
# decode picks of layers 0 and 1; expert 0 of layer 0 is the favourite (5 of 6 tokens), expert 3 never picked
CLI_ROWS = REPLAY_ROWS


@pytest.fixture
def files(tmp_path):
    return write_replay_files(tmp_path)




def replay_json(capsys, folder, *options):
    rc, out, err = run(capsys, "replay", folder / "config.json", "--trace", folder / "trace.jsonl", *options, "--json")
    assert rc == 0, err
    return json.loads(out)


def test_cli_json_fields_and_hand_count_with_every_expert_offloaded(files, capsys):
    doc = replay_json(capsys, files, "--offload-gb", repr(2 * 4 * EXPERT / GiB), "--offload-params", "experts")
    assert set(FIELDS) <= set(doc) and all(isinstance(doc[k], t) for k, t in FIELDS.items())
    # 6 tokens x 4 picks, every one offloaded: 24 reads x 6144 B; no dense, no embedding
    assert doc["tokens"] == 6 and doc["expert_reads"] == 24 and doc["link_bytes_per_token"] == 4 * EXPERT
    assert (doc["cache_hits"], doc["cache_misses"], doc["cache_policy"], doc["cache_bytes"]) == (0, 24, None, 0)
    assert doc["offloaded_bytes"] == 49152 and doc["policy"] == "explicit"


def test_cli_sparse_first_frequency_and_oracle(files, capsys):
    budget = ("--offload-gb", repr((16384 + 3 * EXPERT) / GiB))   # the embedding + 3 experts' worth
    sparse = replay_json(capsys, files, *budget)
    # sparse-first (34816 B): the embedding (16384), layer 0's gate_up_proj whole (16384), then the last expert of
    # layer 0's down_proj (2048). Each of the 12 layer-0 picks reads its 4096 B gate_up slice; + 6 rows of 128
    assert sparse["expert_reads"] == 12 and sparse["link_bytes_per_token"] == (6 * 128 + 12 * 4096) / 6
    oracle = replay_json(capsys, files, *budget, "--policy", "oracle")
    # the trace's own counts: layer 0 [5, 4, 3, 0], layer 1 [4, 3, 5, 0] -> p = (c + 1) / 8; after the embedding
    # (1/128): L0e3 and L1e3 (1/8, never picked), then L0e2 (4/8, tied with L1e1: layer 0 first). L0e2 is
    # picked 3 times: 3 reads
    assert oracle["policy"] == "oracle" and oracle["expert_reads"] == 3
    assert oracle["link_bytes_per_token"] == (6 * 128 + 3 * EXPERT) / 6 < sparse["link_bytes_per_token"]
    freq = replay_json(capsys, files, *budget, "--policy", "frequency", "--stats", files / "trace.jsonl")
    assert {k: v for k, v in freq.items() if k != "policy"} == {k: v for k, v in oracle.items() if k != "policy"}
    assert freq["policy"] == "frequency"


def test_cli_plan_file_and_cache(files, capsys):
    rc, _, err = run(capsys, "plan", files / "config.json", "--offload-gb", repr(49152 / GiB), "--offload-params",
                     "experts", "--save", files / "plan.json")
    assert rc == 0, err
    doc = replay_json(capsys, files, "--plan", files / "plan.json")
    assert doc["expert_reads"] == 24 and doc["policy"] == "explicit"
    # A cache that holds every offloaded expert (8 x 6144 B) misses each expert once only, whatever the policy:
    # 6 distinct keys are picked (experts 0, 1, 2 of both layers; expert 3 never).
    for policy in ("lru", "belady"):
        cached = replay_json(capsys, files, "--plan", files / "plan.json", "--cache-gb", repr(8 * EXPERT / GiB),
                             "--cache-policy", policy)
        assert (cached["cache_misses"], cached["cache_hits"], cached["expert_reads"]) == (6, 18, 6)
        assert cached["cache_policy"] == policy and cached["cache_bytes"] == 8 * EXPERT
        assert cached["link_bytes_per_token"] == 6 * EXPERT / 6


@pytest.mark.parametrize("mutate,message", [
    (lambda p: p.write_text(p.read_text().replace('"phase": "decode"', '"phase": "decoding"', 1)),
     r"trace.jsonl:3: phase 'decoding' is neither"),
    (lambda p: p.write_text(p.read_text().replace('"num_experts": 4', '"num_experts": 8')),
     "records 8 experts per layer but the qwen3_moe model .* has 4"),
    (lambda p: p.write_text(p.read_text().replace('"layers": [0, 1]', '"layers": [0, 2]')),
     r"routes layers \[0, 1\] \(missing \[1\]; not routed in the model \[2\]\)"),
])
def test_cli_bad_trace_exits_2_naming_the_problem(files, capsys, mutate, message):
    mutate(files / "trace.jsonl")
    rc, out, err = run(capsys, "replay", files / "config.json", "--trace", files / "trace.jsonl", "--offload-gb",
                       "0.00001", "--json")
    assert rc == 2 and out == "" and err.startswith("error: ") and err.count("\n") == 1
    assert re.search(message, err), err


@pytest.mark.parametrize("argv,message", [
    (["plan", "{c}", "--offload-gb", "0.00001", "--policy", "frequency"], "--policy frequency needs --stats TRACE"),
    (["replay", "{c}", "--trace", "{t}", "--offload-gb", "0.00001", "--policy", "frequency"],
     "--policy frequency needs --stats TRACE"),
    (["plan", "{c}", "--offload-gb", "0.00001", "--policy", "oracle"], "invalid choice: 'oracle'"),
    (["replay", "{c}", "--trace", "{t}", "--policy", "oracle", "--stats", "{t}"], "--policy oracle takes its"),
    (["replay", "{c}", "--trace", "{t}", "--plan", "{t}", "--offload-gb", "1"], "--plan and --offload-gb both"),
    (["replay", "{c}", "--trace", "{t}", "--cache-policy", "lru"], "--cache-policy lru without --cache-gb"),
    (["plan", "{c}", "--offload-gb", "0.00001", "--policy", "frequency", "--stats", "{e}"], "no decode tokens"),
])
def test_cli_user_errors_exit_2(files, capsys, argv, message):
    write_trace(files / "empty.jsonl", TraceHeader("qwen3_moe", 4, 2, (0, 1)),
                [TraceRow(0, 0, "prefill", ((0,), (1,)))])
    names = {"c": files / "config.json", "t": files / "trace.jsonl", "e": files / "empty.jsonl"}
    rc, out, err = run(capsys, *[a.format(**names) for a in argv])
    assert rc == 2 and out == "" and err.startswith("error: ") and message in err, err


def test_cli_plan_with_frequency_stats(files, capsys):
    rc, out, err = run(capsys, "plan", files / "config.json", "--offload-gb", repr((16384 + 3 * EXPERT) / GiB),
                       "--policy", "frequency", "--stats", files / "trace.jsonl", files / "trace.jsonl", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    # two copies of the trace: counts L0 [10, 8, 6, 0], L1 [8, 6, 10, 0] (24 picks) -> p = 2 (c + 1) / 28. After the
    # embedding (1/128 < 1/14): L0e3, L1e3 (1/14), then L0e2 (7/14, tied with L1e1: layer 0 first)
    ids = {t["name"]: t["host_expert_ids"] for t in doc["tensors"] if t["host_expert_ids"]}
    assert ids == {"model.layers.0.mlp.experts.gate_up_proj": [2, 3], "model.layers.0.mlp.experts.down_proj": [2, 3],
                   "model.layers.1.mlp.experts.gate_up_proj": [3], "model.layers.1.mlp.experts.down_proj": [3]}
    assert doc["policy"] == "frequency" and doc["offloaded_bytes"] == 16384 + 3 * EXPERT
    assert doc["expert_densities"]["0"] == pytest.approx([11 / 14, 9 / 14, 7 / 14, 1 / 14])


# --- scale --------------------------------------------------------------------------------------------------


def test_a_1t_parameter_model_replays_1e5_tokens_over_60_layers_in_seconds(tmp_path):
    from moe_offload.planning import planner
    from moe_offload.model import published
    from moe_offload.model.inventory import inventory

    inv = inventory(published.write("kimi-k2", tmp_path / "kimi"))
    tb = planner.plan(inv, offload_gb=500).token_bytes()
    assert len(tb.layers) == 60 and tb.num_experts == 384 and tb.top_k == 8
    # Skewed synthetic routing, 8 distinct experts per token: a Zipf-like first pick, then 7 at stride 48.
    rng = np.random.default_rng(0)
    t, e = 100_000, 384
    weights = 1.0 / np.arange(1, e + 1)
    first = rng.choice(e, size=(t, 60), p=weights / weights.sum())
    ids = ((first[..., None] + 48 * np.arange(8)) % e).astype(np.int16)   # [T, 60, 8]
    start = time.perf_counter()
    cost = replay_routing(tb, ids)
    elapsed = time.perf_counter() - start
    assert elapsed < 10, f"{elapsed:.1f} s"
    # the same total from per-expert pick counts
    counts = np.stack([np.bincount(ids[:, i, :].ravel(), minlength=e) for i in range(60)])
    assert cost.host_bytes == t * tb.dense_host + int((counts * tb.expert_host).sum())
    # frequency placement from these counts, at the same budget, reads less than sparse-first on them
    stats = {layer: counts[i].tolist() for i, layer in enumerate(tb.layers)}
    freq = planner.plan(inv, offload_gb=500, policy="frequency", stats=stats)
    cost_f = replay_routing(freq.token_bytes(), ids)
    assert cost_f.host_bytes < cost.host_bytes
    assert cost_f.host_bytes / t == pytest.approx(freq.link_bytes_per_token(), rel=0.02)
