"""Replay with host compute (routing/replay_compute.py): per layer step, which experts run where, the bytes each side
moves, and the time the cost model predicts, counted by hand.

The planner's toy model (tests/fixtures_records.py): bfloat16, hidden 8, 2 layers, E=4, top-2. One expert is
gate_up 128 B + down 64 B = 192 B and 64 + 32 = 96 parameters, so a (token, expert) pair is F = 192 FLOPs; a token's
hidden state is 8 x 2 = 16 B. Dense weights a decode token reads: 2 x 352 B of layers, the final norm 16 B, the LM
head 256 B, one embedding row 16 B: 992 B. The trace is test_replay.py's: decode picks per (token, layer)
(1,0)(2,3) | (1,2)(0) | (3,0)(2,1).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from moe_offload.formats.traces import Trace, TraceHeader, TraceRow, routing_array
from moe_offload.planning.cost_model import ExpertCompute, Hardware, step_cost
from moe_offload.planning.placement import GiB
from moe_offload.planning.planner import plan
from moe_offload.routing.cache_policy import make_cache
from moe_offload.routing.replay import replay, replay_routing, walk_caches
from moe_offload.routing.replay_compute import compute_replay, compute_shape, replay_compute
from fixtures_cli import REPLAY_ROWS, QWEN3_EXPERT, run_cli as run, write_replay_files
from fixtures_records import EMBED, FINAL_NORM, LM_HEAD, gb, layer, make_inv

INV = make_inv([EMBED, *layer(0), *layer(1), FINAL_NORM, LM_HEAD])
TRACE = Trace(TraceHeader("qwen3_moe", 4, 2, (0, 1)), (
    TraceRow(0, 0, "prefill", ((0, 1), (0, 1))),   # prefill: not replayed
    TraceRow(0, 1, "decode", ((1, 0), (2, 3))),
    TraceRow(0, 2, "decode", ((1, 2), (0,))),
    TraceRow(0, 3, "decode", ((3, 0), (2, 1))),
), "hand.jsonl")
HIDDEN, F, EXP = 16, 192, 192
PICKS = [[2, 2], [2, 1], [2, 2]]          # per decode token, per layer: experts picked
IDS = routing_array(TRACE.decode_rows, 2, 2)


def frequency_plan():
    """The embedding and L0e1, L1e0, L1e1 offloaded (test_replay.py's frequency plan)."""
    return plan(INV, offload_gb=gb(256 + 3 * 192), policy="frequency", stats={0: [10, 0, 5, 5], 1: [3, 3, 7, 7]})


def experts_plan(**kw):
    """Every routed expert offloaded (1536 B), dense resident."""
    return plan(INV, offload_gb=gb(2 * 4 * EXP), offload_params=("experts",), **kw)


def hw(host_gbps=50.0, host_gflops=500.0, link_gbps=25.0, device_gbps=None, device_tflops=None) -> Hardware:
    return Hardware(host_bytes_per_s=host_gbps * 1e9 if host_gbps else None,
                    host_flops_per_s=host_gflops * 1e9 if host_gflops else None,
                    link_bytes_per_s=link_gbps * 1e9 if link_gbps else None,
                    device_bytes_per_s=device_gbps * 1e9 if device_gbps else None,
                    device_flops_per_s=device_tflops * 1e12 if device_tflops else None)


def test_the_shape_of_the_toy_plan():
    s = compute_shape(experts_plan())
    assert s.hidden_bytes == HIDDEN and s.flops_per_pair.tolist() == [F, F]
    assert s.expert_bytes.tolist() == [[EXP] * 4] * 2 and s.device_dense_bytes == 992
    assert compute_shape(frequency_plan()).device_dense_bytes == 976   # the embedding row is offloaded there


def on_disk():
    """Layer 0's experts on disk, layer 1's in host memory (a host tier of 4 experts)."""
    return experts_plan(host_memory_gb=gb(4 * EXP))


# (plan, mode, hardware, device cache, host cache: heat caches of so many experts)
CASES = {
    "every expert offloaded": (experts_plan, hw(), 0, 0),
    "frequency split": (frequency_plan, hw(device_gbps=1000), 0, 0),
    "half the experts on disk": (on_disk, hw(), 0, 0),
    "heat cache of 2 experts": (experts_plan, hw(), 2, 0),
    "disk, device cache and host cache": (on_disk, hw(), 2, 3),
    "disk and a host cache": (on_disk, hw(), 0, 2),
}


@pytest.mark.parametrize("mode", [ExpertCompute.DEVICE, ExpertCompute.HOST])
@pytest.mark.parametrize("name", CASES)
def test_each_side_moves_what_replay_counts(name, mode):
    make, machine, device_cache, host_cache = CASES[name]
    p = make()
    tb = p.token_bytes()

    def caches():
        return dict(cache=make_cache("heat", device_cache * EXP) if device_cache else None,
                    host_cache=make_cache("heat", host_cache * EXP) if host_cache else None)

    used = caches()
    walked = replay_routing(tb, IDS, **used)
    assert bool(walked.cache_hits) == bool(device_cache)    # each cache of the table is used
    assert bool(used["host_cache"] and used["host_cache"].hits) == bool(host_cache)
    r = replay_compute(compute_shape(p), IDS, mode, machine, **caches())
    link = (walked.host_bytes + walked.disk_bytes) / 3     # replay's link bytes per token
    expert_link = link - tb.dense_host - tb.dense_disk
    assert r.tokens == 3 and r.steps == 6 and r.experts_on_host + r.experts_on_device == 11
    if mode is ExpertCompute.DEVICE:
        assert r.link_activation_bytes_per_token == 0 and r.host_read_bytes_per_token == 0
        assert r.link_weight_bytes_per_token == link and r.experts_on_host == 0 and r.steps_on_host == 0
        # the runtime's counters under streaming are replay's, tier by tier
        assert r.counted_host_link_bytes_per_token * 3 == walked.host_bytes
        assert r.counted_disk_read_bytes_per_token * 3 == walked.disk_bytes
    else:
        # Every device-cache miss the cache does not admit is computed where it lies; an admitted one travels to
        # fill its pages (the runtime's read plan): the caches walked once more, admissions noted
        w = walk_caches(tb, IDS, admissions=True, **caches())
        off, disk = (tb.expert_host + tb.expert_disk)[w.lay, w.experts], tb.expert_disk[w.lay, w.experts]
        on_host, admitted = ~w.hit & ~w.admitted, w.admitted
        assert bool(admitted.any()) == bool(device_cache)           # the caches' first misses are taken in
        assert r.experts_on_host == int(on_host.sum()) == walked.expert_reads - int(admitted.sum())
        # no weight crosses the link but the admitted experts' and the offloaded dense (the embedding row)
        assert r.link_weight_bytes_per_token * 3 == int(off[admitted].sum()) + 3 * (tb.dense_host + tb.dense_disk)
        assert r.host_read_bytes_per_token * 3 == int(off[on_host].sum())
        assert r.host_read_bytes_per_token * 3 + int(off[admitted].sum()) == expert_link * 3
        # per step with host-side picks: the hidden state in, one output per host-side pick back
        per_step = np.bincount(w.tok[on_host] * 2 + w.lay[on_host], minlength=6)
        assert r.link_activation_bytes_per_token * 3 == sum(HIDDEN * (1 + n) for n in per_step.tolist() if n)
        # the runtime's counters: only admitted experts' host bytes (and their host-cached disk bytes) cross the
        # link; disk bytes the host cache did not hold are read from disk wherever the expert is computed
        moved = np.where(w.in_host, disk, 0)
        assert r.counted_host_link_bytes_per_token * 3 == 3 * tb.dense_host + int(
            (off - disk + moved)[admitted].sum())
        assert r.counted_disk_read_bytes_per_token * 3 == walked.disk_bytes


def test_only_experts_wholly_off_the_device_are_computed_on_the_host():
    # sparse-first, the embedding and layer 0's gate_up_proj offloaded (its down_proj resident): no expert of
    # layer 0 lies wholly off the device, so in every mode all stream, as the runtime does
    whole = plan(INV, offload_gb=gb(256 + 512))
    r = replay_compute(compute_shape(whole), IDS, ExpertCompute.HOST, hw())
    assert r.experts_on_host == 0 and r.link_weight_bytes_per_token == replay(whole, TRACE).link_bytes_per_token
    # ... and the last expert of layer 0's down_proj too: expert 3 of layer 0 is wholly off, picked once (t3)
    split = plan(INV, offload_gb=gb(256 + 512 + 64))
    assert compute_shape(split).host_ok.tolist() == [[False, False, False, True], [False] * 4]
    r = replay_compute(compute_shape(split), IDS, ExpertCompute.HOST, hw())
    assert (r.experts_on_host, r.host_read_bytes_per_token * 3) == (1, EXP)
    assert r.link_weight_bytes_per_token * 3 == replay(split, TRACE).link_bytes_per_token * 3 - EXP


def test_host_mode_activations_are_hidden_states_in_and_outputs_back():
    # every expert offloaded, no cache: each of the 6 steps sends 16 B in and 16 B per pick back
    r = replay_compute(compute_shape(experts_plan()), IDS, ExpertCompute.HOST, hw())
    assert r.link_activation_bytes_per_token * 3 == sum(HIDDEN + n * HIDDEN for token in PICKS for n in token)
    assert r.link_weight_bytes_per_token == 0 and r.steps_on_host == 6 and r.experts_on_host == 11


def test_expected_time_is_the_formula_by_hand():
    # Frequency split (host: the embedding, L0e1, L1e0, L1e1). Steps (host-side picks P, their bytes B, the
    # device side's stored bytes D): t1 (1, 192, 192) (0, 0, 384); t2 (1, 192, 192) (1, 192, 0);
    # t3 (0, 0, 384) (1, 192, 192)
    steps = [(1, 192, 192), (0, 0, 384), (1, 192, 192), (1, 192, 0), (0, 0, 384), (1, 192, 192)]
    link, host_bw, flops, dev = 25e9, 50e9, 500e9, 1000e9
    machine = Hardware(host_bytes_per_s=host_bw, host_flops_per_s=flops, link_bytes_per_s=link,
                       device_bytes_per_s=dev)
    dense = 976 / dev + 16 / link       # resident dense on the device, the embedding row over the link
    shape = compute_shape(frequency_plan())
    stream = sum(max(b / link, d / dev) for _, b, d in steps) / 3 + dense
    host = sum(max(max(b / host_bw, p * F / flops) + HIDDEN * (1 + p) / link, d / dev) if p else d / dev
               for p, b, d in steps) / 3 + dense
    streamed = replay_compute(shape, IDS, ExpertCompute.DEVICE, machine)
    assert streamed.expected_ms_per_token == pytest.approx(stream * 1e3)
    on_host = replay_compute(shape, IDS, ExpertCompute.HOST, machine)
    assert on_host.expected_ms_per_token == pytest.approx(host * 1e3)
    assert on_host.dense_ms_per_token == pytest.approx(dense * 1e3) and on_host.steps_on_host == 4
    # the host is faster here: auto takes it at every step with host-side experts
    auto = replay_compute(shape, IDS, ExpertCompute.AUTO, machine)
    assert auto.expected_ms_per_token == pytest.approx(host * 1e3) and auto.steps_on_host == 4 and host < stream


def test_expected_time_with_experts_that_must_stream_is_the_formula_by_hand():
    # The embedding, layer 0's gate_up_proj and its expert 3's down_proj offloaded: of layer 0 only expert 3 lies
    # wholly off the device; the others stream their gate_up slice (128 B, S) and read their down slice (64 B) on
    # the device (D). Layer 1 is resident (D = 192 per pick). Steps: t1 L0 (1,0): S 256, D 128 | L1 D 384;
    # t2 L0 (1,2): S 256, D 128 | L1 (0): D 192; t3 L0 (3,0): host-side e3 (B 192) beside S 128, D 64 | L1 D 384
    link, host_bw, flops, dev = 25e9, 50e9, 500e9, 1000e9
    machine = Hardware(host_bytes_per_s=host_bw, host_flops_per_s=flops, link_bytes_per_s=link,
                       device_bytes_per_s=dev)
    shape = compute_shape(plan(INV, offload_gb=gb(256 + 512 + 64)))
    fixed = 2 * max(256 / link, 128 / dev) + (384 + 192 + 384) / dev
    dense = 976 / dev + 16 / link
    host = (fixed + max(max(192 / host_bw, F / flops) + 2 * HIDDEN / link, 128 / link + 64 / dev)) / 3 + dense
    stream = (fixed + max((192 + 128) / link, 64 / dev)) / 3 + dense
    assert replay_compute(shape, IDS, ExpertCompute.HOST, machine).expected_ms_per_token == pytest.approx(host * 1e3)
    r = replay_compute(shape, IDS, ExpertCompute.DEVICE, machine)
    assert r.expected_ms_per_token == pytest.approx(stream * 1e3)


def test_auto_picks_each_step_by_the_cost_model():
    # link 1 B/s: streaming P experts costs 192 P s, the host 192 P / H + 16 (1 + P). With 192 / H = 164 s the host
    # wins a step of 2 picks (328 + 48 = 376 < 384) and loses one of 1 (164 + 32 = 196 > 192).
    machine = Hardware(host_bytes_per_s=192 / 164, host_flops_per_s=1e12, link_bytes_per_s=1.0)
    for p in (1, 2):
        cost = step_cost(machine, tokens=1, pairs=p, weight_bytes=192 * p, flops=F * p, hidden_bytes=HIDDEN)
        assert cost.choice is (ExpertCompute.HOST if p == 2 else ExpertCompute.DEVICE)
    r = replay_compute(compute_shape(experts_plan()), IDS, ExpertCompute.AUTO, machine)
    # 5 steps of 2 picks on the host, the one step of 1 pick (t2, layer 1) streamed
    assert (r.steps_on_host, r.experts_on_host, r.experts_on_device) == (5, 10, 1)
    assert r.link_weight_bytes_per_token * 3 == 192 and r.link_activation_bytes_per_token * 3 == 5 * 48
    assert r.expected_ms_per_token == pytest.approx((5 * 376 + 192) / 3 * 1e3)


def test_without_a_link_nothing_crosses_one():
    # a CPU-only machine: host compute and "streaming" read the same memory; forced host moves no activations
    machine = hw(link_gbps=None)
    for mode in ExpertCompute:
        r = replay_compute(compute_shape(experts_plan()), IDS, mode, machine)
        assert r.link_activation_bytes_per_token == 0
        assert r.expected_ms_per_token == pytest.approx(
            sum(max(192 * n / 50e9, F * n / 500e9) for token in PICKS for n in token) / 3 * 1e3)


def test_host_rates_are_needed_unless_streaming_over_a_link():
    from moe_offload.errors import MoeOffloadError

    shape = compute_shape(experts_plan())
    no_host = hw(host_gbps=None, host_gflops=None)
    r = replay_compute(shape, IDS, ExpertCompute.DEVICE, no_host)
    assert r.expected_ms_per_token == pytest.approx(11 * 192 / 25e9 / 3 * 1e3)
    for mode, machine in ((ExpertCompute.HOST, no_host), (ExpertCompute.AUTO, no_host),
                          (ExpertCompute.DEVICE, hw(host_gbps=None, host_gflops=None, link_gbps=None))):
        with pytest.raises(MoeOffloadError, match="--host-gbps and --host-gflops"):
            replay_compute(shape, IDS, mode, machine)


def test_compute_replay_reads_the_trace_as_replay_does():
    p = experts_plan()
    r = compute_replay(p, TRACE, "device", hw(), cache_gb=2 * EXP / GiB, cache_policy="lru")
    assert r.link_weight_bytes_per_token == replay(p, TRACE, cache_gb=2 * EXP / GiB,
                                                   cache_policy="lru").link_bytes_per_token


def test_many_tokens_are_fast():
    rng = np.random.default_rng(0)
    ids = np.sort(np.stack([rng.permutation(4)[:2] for _ in range(2 * 20_000)]).reshape(20_000, 2, 2), axis=2)
    r = replay_compute(compute_shape(frequency_plan()), ids, ExpertCompute.AUTO, hw(device_gbps=1000))
    assert r.tokens == 20_000 and r.experts_on_host + r.experts_on_device == 80_000


# --- the command ------------------------------------------------------------------------------------------


EXPERT = QWEN3_EXPERT
# decode picks of layers 0 and 1 (test_replay.py's)
CLI_ROWS = REPLAY_ROWS


@pytest.fixture
def files(tmp_path):
    return write_replay_files(tmp_path)


def replay_cli(capsys, folder, *options):
    budget = ("--offload-gb", repr(2 * 4 * EXPERT / GiB), "--offload-params", "experts")
    return run(capsys, "replay", folder / "config.json", "--trace", folder / "trace.jsonl", *budget, *options)


def test_cli_predicts_with_the_flags_and_keeps_replay_as_it_was(files, capsys):
    rc, plain, err = replay_cli(capsys, files, "--json")
    assert rc == 0, err
    plain = json.loads(plain)
    assert "expected_ms_per_token" not in plain
    rates = ("--device", "cuda", "--link-gbps", "25", "--host-gbps", "50", "--host-gflops", "500")
    rc, out, err = replay_cli(capsys, files, "--expert-compute", "host", *rates, "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert {k: doc[k] for k in plain} == plain                  # replay's fields unchanged
    # QWEN3_CONFIG: float32, hidden 32 (128 B), one expert 6144 B = 3 x 32 x 16 x 2 x ... 1536 params: F = 3072
    # 6 tokens x 2 layers, 2 picks each, all on the host: per step max(12288 / 50e9, 6144 / 500e9) + 384 / 25e9
    step = max(2 * EXPERT / 50e9, 2 * 3072 / 500e9) + 3 * 128 / 25e9
    assert doc["expected_ms_per_token"] == pytest.approx(2 * step * 1e3)
    assert (doc["expert_compute"], doc["link_weight_bytes_per_token"], doc["link_activation_bytes_per_token"],
            doc["host_read_bytes_per_token"]) == ("host", 0.0, 2 * 384.0, 4 * EXPERT)
    assert doc["hardware"]["link_bytes_per_s"] == 25e9 and doc["formula"].startswith("ms/token = ")
    rc, out, err = replay_cli(capsys, files, *rates)             # a rate alone: streaming, predicted
    assert rc == 0 and "expert compute device, predicted for link 25 GB/s" in out and "ms per decoded token" in out
    assert "a prediction, not a measurement" in out


def test_cli_plan_file_takes_device_as_the_machine_predicted(files, capsys):
    rc, _, err = run(capsys, "plan", files / "config.json", "--offload-gb", repr(2 * 4 * EXPERT / GiB),
                     "--offload-params", "experts", "--save", files / "plan.json")
    assert rc == 0, err
    base = ("replay", files / "config.json", "--trace", files / "trace.jsonl", "--plan", files / "plan.json")
    rc, out, err = run(capsys, *base, "--expert-compute", "auto", "--device", "cuda", "--link-gbps", "25",
                       "--host-gbps", "50", "--host-gflops", "500", "--json")
    assert rc == 0, err
    assert json.loads(out)["steps_on_host"] == 12
    rc, out, err = run(capsys, *base, "--device", "cuda")         # no prediction: --device still decides nothing
    assert rc == 2 and "--plan and --device both decide the placement" in err


@pytest.mark.parametrize("options,message", [
    (["--expert-compute", "host", "--device", "cuda", "--link-gbps", "25"],
     "--expert-compute host needs the host's rates, and --host-gbps and --host-gflops are missing"),
    (["--expert-compute", "auto", "--device", "cuda", "--link-gbps", "25", "--host-gbps", "50"],
     "and --host-gflops is missing"),
    (["--expert-compute", "host", "--device", "cuda", "--host-gbps", "50", "--host-gflops", "500"],
     "needs the link's rate: give --link-gbps X"),
    (["--link-gbps", "25", "--device", "cpu"], "--link-gbps 25.0 for a CPU-only machine (--device cpu)"),
    (["--expert-compute", "device", "--device", "cpu"], "on a CPU-only machine every expert is computed by the host"),
    (["--expert-compute", "host", "--device", "cuda", "--link-gbps", "0", "--host-gbps", "50", "--host-gflops", "5"],
     "--link-gbps 0.0 is not a rate: give a positive number of GB/s"),
    (["--device-tflops", "nan", "--device", "cuda", "--link-gbps", "25"], "--device-tflops nan is not a rate"),
])
def test_cli_refuses_a_machine_it_cannot_time(files, capsys, options, message):
    rc, out, err = replay_cli(capsys, files, *options, "--json")
    assert rc == 2 and out == "" and err.startswith("error: ") and err.count("\n") == 1
    assert message in err, err
