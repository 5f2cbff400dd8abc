"""Look-ahead in traces and replay: `profile --predict` rows carry `predicted`, the format checks it, and replay's
look-ahead hits, misses and wasted bytes equal the runtime's (run/lookahead.py) for the same generation."""

from __future__ import annotations

import json

import pytest
import torch

import moe_offload as mo
from moe_offload.errors import TraceError
from moe_offload.formats.traces import TraceWriter, read_trace
from moe_offload.loading.loader import load_tokenizer
from moe_offload.measure.profile import record, trace_header
from moe_offload.routing.replay import replay
from moe_offload.tiny.make import make_tiny


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("la") / "m", family="qwen3_moe", layers=4, experts=16, top_k=2,
                     hidden=128)


def _disk_bound(folder, **kw):
    return mo.load(folder, device_memory_gb=1.003, reserve_gb=1, cpu_only=True, **kw)


@pytest.mark.parametrize("host_cache_gb,cache_gb", [(None, None), (0.0005, None), (None, 0.0003), (0.0005, 0.0003)],
                         ids=["disk", "host-cache", "device-cache", "both-caches"])
def test_replay_of_a_predicted_trace_counts_what_the_runtime_counted(folder, tmp_path, host_cache_gb, cache_gb):
    """With a device cache above the disk tier, an expert it held as its layer began may be evicted by an earlier
    expert of the same step and read after all: a miss of the look-ahead's, counted alike by both."""
    model, plan = _disk_bound(folder, lookahead=1, host_cache_gb=host_cache_gb, cache_gb=cache_gb)
    assert any(t.tier == "disk" for t in plan.tensors)
    path = tmp_path / "t.jsonl"
    with TraceWriter(path, trace_header(plan, "test")) as w:
        record(model, load_tokenizer(folder), ["The storm reached the coast", "A river"], w, max_new_tokens=10,
               ignore_eos=True, predict=True)
    trace = read_trace(path)
    assert all(r.predicted is not None for r in trace.decode_rows)
    assert all(r.predicted is None for r in trace.rows if r.phase == "prefill")
    assert all(r.predicted[0] == () for r in trace.decode_rows)   # layer 0: no layer before it to predict from
    got = replay(plan, trace, host_cache_gb=host_cache_gb, cache_gb=cache_gb)
    st = model.moe_offload_runtime.lookahead.stats(got.tokens)
    assert got.tokens == 20
    assert (got.lookahead_hits, got.lookahead_misses) == (st["lookahead_hits"], st["lookahead_misses"])
    assert got.lookahead_hits > 0 and got.lookahead_misses > 0
    # replay reads every unpicked guess in full; the runtime stops some of them (cancelled) before they are read
    runtime_guessed = st["lookahead_wasted_bytes_per_token"] + st["lookahead_cancelled_bytes_per_token"]
    assert got.lookahead_wasted_bytes_per_token == pytest.approx(runtime_guessed, rel=1e-12)
    assert got.lookahead_wasted_bytes_per_token > 0


def test_a_trace_without_predictions_replays_without_lookahead_figures(folder, tmp_path):
    model, plan = _disk_bound(folder)
    path = tmp_path / "t.jsonl"
    with TraceWriter(path, trace_header(plan, "test")) as w:
        record(model, load_tokenizer(folder), ["A river"], w, max_new_tokens=4, ignore_eos=True)
    r = replay(plan, read_trace(path))
    assert (r.lookahead_hits, r.lookahead_misses, r.lookahead_wasted_bytes_per_token) == (None, None, None)
    assert "predicted" not in path.read_text().splitlines()[-1]


@pytest.mark.parametrize("bad", [[[1]], [[1], [99]], [[1, 1], []], "x", [[1.5], []]])
def test_a_malformed_predicted_list_is_a_trace_error_naming_the_line(tmp_path, bad):
    header = {"format": "moe-offload-trace", "version": 1, "model_type": "qwen3_moe", "num_experts": 8, "top_k": 2,
              "layers": [0, 1]}
    row = {"seq": 0, "pos": 0, "phase": "decode", "experts": [[1, 2], [3, 4]], "predicted": bad}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(header) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(TraceError, match=r"t.jsonl:2: predicted"):
        read_trace(path)


def test_predicted_round_trips(tmp_path):
    header = {"format": "moe-offload-trace", "version": 1, "model_type": "qwen3_moe", "num_experts": 8, "top_k": 2,
              "layers": [0, 1]}
    row = {"seq": 0, "pos": 3, "phase": "decode", "experts": [[1, 2], [3, 4]], "predicted": [[], [3, 7]]}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(header) + "\n" + json.dumps(row) + "\n")
    (r,) = read_trace(path).rows
    assert r.predicted == ((), (3, 7)) and r.to_dict() == row


def test_profile_cli_predict_writes_predictions(folder, tmp_path, capsys):
    from moe_offload.cli.main import main

    out = tmp_path / "p.jsonl"
    assert main(["profile", str(folder), "--out", str(out), "--max-new-tokens", "3", "--ignore-eos", "--predict",
                 "--prompts", str(_prompts(tmp_path))]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()[1:]]
    decode = [r for r in rows if r["phase"] == "decode"]
    assert len(decode) == 3 and all(len(r["predicted"]) == 4 for r in decode)
    assert all(r["predicted"][1] for r in decode)   # layer 1 predicted from layer 0


def _prompts(tmp_path):
    p = tmp_path / "prompts.txt"
    p.write_text("The storm reached the coast\n")
    return p


torch.set_num_threads(1)
