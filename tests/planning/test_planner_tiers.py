"""Three tiers (tiers.py): device, host (--host-memory) and disk, planned on byte-exact toy budgets.

Toy model of tests/test_planner.py (bfloat16, E=4, top-k 2), two layers unless said otherwise:
    model.embed_tokens.weight                (16, 8)    256 B   embedding, density 1/16 (one row: 16 B)
    per layer: norms 16 + 16, q 128, o 128, router 64          352 B   dense, density 1
               mlp.experts.gate_up_proj (4, 8, 8)  512 B = 4 x 128 B   routed, density 1/2
               mlp.experts.down_proj    (4, 8, 4)  256 B = 4 x  64 B   routed, density 1/2
    model.norm.weight 16 B, lm_head.weight 256 B
    whole model: 256 + 2 x 1120 + 16 + 256 = 2768 B
Sparse-first order: embedding, then the experts (L0 gate_up, L0 down, L1 gate_up, L1 down), then dense.
"""

from __future__ import annotations

import json

import pytest

import moe_offload as mo
from moe_offload.errors import BudgetError, MoeOffloadError
from moe_offload.planning.planner import plan
from moe_offload.planning.placement import GiB, Plan
from moe_offload.routing.replay import replay
from moe_offload.formats.traces import Trace, TraceHeader, TraceRow, write_trace
from fixtures_records import EMBED, FINAL_NORM, LM_HEAD, gb, layer, make_inv, with_buffer
from fixtures_cli import QWEN3_CONFIG, run_cli as cli

INV = make_inv([EMBED, *layer(0), *layer(1), FINAL_NORM, LM_HEAD])   # 2768 B
ONE = make_inv([EMBED, *layer(0), FINAL_NORM, LM_HEAD])               # 1648 B
EMB, GU, DN = "model.embed_tokens.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"


def by_name(p: Plan) -> dict:
    return {t.name: t for t in p.tensors}


def where(p: Plan) -> dict[str, str]:
    return {t.name: t.tier for t in p.tensors if t.tier != "device"}


# --- sparse-first --------------------------------------------------------------------------------------------

def test_sparse_first_lowest_densities_go_furthest_by_hand():
    # 1792 B leave the device: the embedding 256 + every expert 1536. The host holds 1000 B, so 792 B go to
    # disk in the same order, by whole units (the disk tier reads a tensor's experts from disk or from memory,
    # not both): the embedding (256), L0 gate_up (512; 24 B left), L0 down_proj (256). Disk 1024 B, host 768 B.
    p = plan(INV, offload_gb=gb(1792), host_memory_gb=gb(1000))
    t = by_name(p)
    assert where(p) == {EMB: "disk", f"model.layers.0.{GU}": "disk", f"model.layers.0.{DN}": "disk",
                        f"model.layers.1.{GU}": "host", f"model.layers.1.{DN}": "host"}
    down = t[f"model.layers.0.{DN}"]
    assert (down.host_ids, down.disk_ids, down.memory_ids) == ((), (), ())
    assert (down.offloaded_bytes, down.disk_bytes, down.host_bytes) == (256, 256, 0)
    assert (p.offloaded_bytes, p.disk_bytes, p.host_bytes, p.host_budget_bytes) == (1792, 1024, 768, 1000)
    # per token, uniform routing (1/2 per expert): disk row 16 + 512/2 + 256/2 = 400; host 768/2 = 384
    assert p.link_bytes_by_tier() == (384.0, 400.0) and p.link_bytes_per_token() == 784.0
    note = next(n for n in p.notes if n.startswith("disk tier:"))
    assert "1.00 KiB (1024 bytes) of the 1.75 KiB offloaded do not fit the 1000 B host tier (768 B there)" in note
    assert "3 tensors whole and 0 in part" in note and "400 B from disk and 384 B from host memory" in note
    # the device keeps what the two-tier plan keeps: the disk cut only divides what left it
    two = plan(INV, offload_gb=gb(1792))
    assert {n: x.offloaded_bytes for n, x in by_name(two).items()} == {n: x.offloaded_bytes for n, x in t.items()}


def test_experts_the_device_cut_took_go_to_disk_together():
    # One layer. 448 B leave: the embedding and the last 3 experts (ids 1-3, 3 x 64 B) of down_proj, the
    # smallest slice covering 192 B. Host room 100 B: 348 B to disk: the embedding, then down_proj's offloaded
    # experts as one unit (192 B): expert 0 on the device, 1-3 on disk, nothing of it in host memory.
    p = plan(ONE, offload_gb=gb(448), host_memory_gb=gb(100))
    down = by_name(p)[f"model.layers.0.{DN}"]
    assert down.tier == "disk" and down.host_experts == 3 and down.disk_expert_ids == ()
    assert (down.host_ids, down.disk_ids, down.memory_ids, down.resident_experts) == ((1, 2, 3), (1, 2, 3), (), 1)
    assert (p.disk_bytes, p.host_bytes) == (256 + 192, 0)
    assert "experts 1-3 of 4 on disk, the others on the device" in down.reason
    tb = p.token_bytes()
    assert tb.expert_bytes(0) == ((0, 0, 0, 0), (0, 64, 64, 64))
    assert tb.bytes_for_token([(0, 1)]) == (0, 16 + 64) and tb.bytes_for_token([(2, 3)]) == (0, 16 + 128)


@pytest.mark.parametrize("offload, room", [(300, 0), (300, 44), (1000, 300), (1792, 1), (1792, 1535), (2000, 700),
                                           (2768, 1000), (2768, 0)])
def test_the_disk_holds_the_lowest_densities_and_the_host_fits(offload, room):
    p = plan(INV, offload_gb=gb(offload), host_memory_gb=gb(room))
    two = plan(INV, offload_gb=gb(offload))
    assert p.offloaded_bytes == two.offloaded_bytes and p.host_bytes <= room
    assert p.disk_bytes >= p.offloaded_bytes - room
    # every byte on disk is of a density no higher than any byte in host memory
    dens = {t.name: t.density() for t in p.tensors}
    disk = [dens[t.name] for t in p.tensors if t.disk_bytes]
    host = [dens[t.name] for t in p.tensors if t.host_bytes]
    assert not disk or not host or max(disk) <= min(host)
    # the overshoot of the disk cut is below one unit: an expert slice (64 B) among experts, else one tensor
    over = p.disk_bytes - (p.offloaded_bytes - room)
    assert over < max((t.disk_bytes for t in p.tensors), default=1)


def test_a_host_that_holds_everything_offloaded_leaves_the_disk_empty():
    p = plan(INV, offload_gb=gb(1000), host_memory_gb=gb(1024))
    two = plan(INV, offload_gb=gb(1000))
    assert p.tensors == two.tensors and p.disk_bytes == 0 and p.host_budget_bytes == 1024
    assert "the host tier (1.00 KiB) holds all 1.00 KiB offloaded: nothing on disk" in p.notes


def test_declaration_moves_whole_tensors_to_disk_in_its_own_order():
    # declaration: 400 B = embedding 256, input_layernorm 16, q_proj 128. Host 200 B: the first 200 B of the
    # same order go to disk: the embedding, whole (256 B). Host: 144 B.
    p = plan(ONE, offload_gb=gb(400), policy="declaration", host_memory_gb=gb(200))
    assert where(p) == {EMB: "disk", "model.layers.0.input_layernorm.weight": "host",
                        "model.layers.0.self_attn.q_proj.weight": "host"}
    assert (p.disk_bytes, p.host_bytes) == (256, 144)
    assert not any(t.host_experts or t.disk_expert_ids for t in p.tensors)
    # explicit selectors: declaration order among the selected, whole tensors. 1536 B leave, host 1000 B: 536 B
    # to disk: L0 gate_up (512 B), then L0 down (256 B) whole, although 24 B of it would do. Host: layer 1's.
    e = plan(INV, offload_gb=gb(1536), offload_params="experts", host_memory_gb=gb(1000))
    assert where(e) == {f"model.layers.0.{GU}": "disk", f"model.layers.0.{DN}": "disk",
                        f"model.layers.1.{GU}": "host", f"model.layers.1.{DN}": "host"}
    assert (e.disk_bytes, e.host_bytes) == (768, 768)


def test_buffers_stay_in_memory_and_a_host_too_small_for_them_is_an_error():
    # with_buffer(): one layer + a 16 B float32 router buffer; 1664 B in all. Everything leaves the device.
    p = plan(with_buffer(), offload_gb=gb(1664), host_memory_gb=gb(16))
    buf = by_name(p)["model.layers.0.mlp.gate.e_score_correction_bias"]
    assert buf.tier == "host" and p.host_bytes == 16 and p.disk_bytes == 1648
    with pytest.raises(BudgetError, match=r"host memory too small: .*1664 bytes\) leave the device .* 1664 bytes "
                                          r"must go to disk, but only 1648 bytes of it may .* 16 bytes must stay"):
        plan(with_buffer(), offload_gb=gb(1664), host_memory_gb=0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(offload_gb=gb(100), host_memory_gb=-1), "host_memory_gb=-1 is not a size"),
    (dict(offload_gb=gb(100), host_memory_gb=float("nan")), "host_memory_gb=nan is not a size"),
    (dict(host_memory_gb=1), "without offload_gb or device_memory_gb nothing leaves it"),
    (dict(host_memory_gb=1, cpu_only=True), "without offload_gb or device_memory_gb nothing leaves it"),
])
def test_bad_host_budgets_are_budget_errors(kwargs, message):
    with pytest.raises(BudgetError, match=message):
        plan(INV, **kwargs)


# --- frequency -----------------------------------------------------------------------------------------------

STATS = {0: [10, 0, 5, 5], 1: [3, 3, 7, 7]}   # tests/test_planner_frequency.py: p L0 [11/12, 1/12, 1/2, 1/2],
UNIT = 192                                     # L1 [1/3, 1/3, 2/3, 2/3]; order L0e1, L1e0, L1e1, L0e2, L0e3, ...


def test_frequency_three_tiers_by_expert():
    # 1216 B leave: the embedding + 5 units (L0e1, L1e0, L1e1, L0e2, L0e3). Host 384 B (2 units): 832 B to disk:
    # the embedding and the 3 least picked units (L0e1, L1e0, L1e1), exactly. Host: L0e2, L0e3.
    p = plan(INV, offload_gb=gb(256 + 5 * UNIT), policy="frequency", stats=STATS, host_memory_gb=gb(2 * UNIT))
    t = by_name(p)
    for w in (GU, DN):   # an expert's slices of its layer's tensors go together
        l0, l1 = t[f"model.layers.0.{w}"], t[f"model.layers.1.{w}"]
        assert (l0.tier, l0.host_expert_ids, l0.disk_ids, l0.memory_ids) == ("disk", (1, 2, 3), (1,), (2, 3))
        assert (l1.tier, l1.host_expert_ids, l1.disk_ids, l1.memory_ids) == ("disk", (0, 1), (0, 1), ())
        assert l1.disk_expert_ids == ()    # all its offloaded experts on disk: tier "disk" says it
    assert t[EMB].tier == "disk" and (p.disk_bytes, p.host_bytes) == (256 + 3 * UNIT, 2 * UNIT)
    # per token with the measured frequencies: disk 16 + 192 x (1/12 + 1/3 + 1/3) = 160; host 192 x (1/2 + 1/2)
    host, disk = p.link_bytes_by_tier()
    assert host == pytest.approx(192) and disk == pytest.approx(160)


# --- CPU-only: the device is host memory ---------------------------------------------------------------------

def test_cpu_only_device_memory_alone_puts_what_does_not_fit_on_disk():
    # device 2000 B, no reserve: 768 B must leave (embedding 256 + L0 gate_up 512), all of it to disk
    p = plan(INV, device_memory_gb=gb(2000), reserve_gb=0, cpu_only=True)
    assert where(p) == {EMB: "disk", f"model.layers.0.{GU}": "disk"}
    assert (p.resident_bytes, p.host_bytes, p.disk_bytes, p.host_budget_bytes) == (2000, 0, 768, 0)
    assert any(n.startswith("CPU-only: the device is this machine's memory") and "(1.95 KiB resident)" in n
               for n in p.notes)
    # with an accelerator the same budget offloads to the host, as before
    gpu = plan(INV, device_memory_gb=gb(2000), reserve_gb=0)
    assert where(gpu) == {EMB: "host", f"model.layers.0.{GU}": "host"} and gpu.host_budget_bytes is None
    # --offload-gb on a CPU-only machine still offloads to (ordinary) host memory; --host-memory makes a host tier
    assert where(plan(INV, offload_gb=gb(768), cpu_only=True)) == where(gpu)
    both = plan(INV, device_memory_gb=gb(2000), reserve_gb=0, cpu_only=True, host_memory_gb=gb(512))
    assert where(both) == {EMB: "disk", f"model.layers.0.{GU}": "host"}


def test_cpu_only_model_that_fits_offloads_nothing():
    p = plan(INV, device_memory_gb=gb(2768), reserve_gb=0, cpu_only=True)
    assert p.offloaded_bytes == 0 and p.disk_bytes == 0


# --- the plan as data ----------------------------------------------------------------------------------------

def test_json_fields_and_round_trip():
    p = plan(ONE, offload_gb=gb(448), host_memory_gb=gb(100))
    data = json.loads(p.to_json())
    assert (data["disk_bytes"], data["host_bytes"], data["host_budget_bytes"]) == (448, 0, 100)
    assert data["host_link_bytes_per_token"] + data["disk_read_bytes_per_token"] == data["link_bytes_per_token"]
    # disk: row 16 + 3 x 64 x 1/2 = 112; host: nothing
    assert (data["host_link_bytes_per_token"], data["disk_read_bytes_per_token"]) == (0.0, 112.0)
    down = next(t for t in data["tensors"] if t["name"].endswith(DN))
    assert (down["tier"], down["host_experts"], down["disk_expert_ids"]) == ("disk", 3, [])
    assert Plan.from_json(p.to_json()) == p and Plan.from_json(p.to_json(indent=1)) == p
    # the data model also holds one tensor in three tiers (a plan made elsewhere): expert 0 on the device,
    # 1 in host memory, 2-3 on disk; host 64 x 1/2 = 32 B per token, disk 16 + 2 x 64 x 1/2 = 80 B
    down["disk_expert_ids"] = [2, 3]
    three = Plan.from_json(json.dumps(data))
    assert (three.disk_bytes, three.host_bytes, three.link_bytes_by_tier()) == (384, 64, (32.0, 80.0))
    assert Plan.from_json(three.to_json()) == three
    # a plan written before the disk tier (no disk fields) still reads, with none of it on disk
    old = json.loads(plan(INV, offload_gb=gb(300)).to_json())
    for key in ("disk_bytes", "host_bytes", "host_budget_bytes", "host_link_bytes_per_token",
                "disk_read_bytes_per_token"):
        del old[key]
    for t in old["tensors"]:
        del t["disk_expert_ids"]
    back = Plan.from_json(json.dumps(old))
    assert back == plan(INV, offload_gb=gb(300)) and back.disk_bytes == 0 and back.host_budget_bytes is None


@pytest.mark.parametrize("change, message", [
    (dict(tier="host"), "with tier 'host'; a tensor with experts on disk has tier 'disk'"),
    (dict(disk_expert_ids=[0]), r"experts \[0\] are not among the experts off the device"),
    (dict(disk_expert_ids=[3, 2]), "must be ascending, distinct and below 4"),
    (dict(disk_expert_ids=[2, 4]), "must be ascending, distinct and below 4"),
])
def test_inconsistent_disk_experts_in_a_saved_plan_are_user_errors(change, message):
    data = json.loads(plan(ONE, offload_gb=gb(448), host_memory_gb=gb(100)).to_json())
    down = next(t for t in data["tensors"] if t["name"].endswith(DN))
    down["disk_expert_ids"] = [2, 3]   # a valid plan with expert 1 in host memory, 2-3 on disk; then broken
    down.update(change)
    with pytest.raises(MoeOffloadError, match=message):
        Plan.from_json(json.dumps(data))


# --- replay: a cache serves host and disk experts alike ------------------------------------------------------

def test_replay_of_a_hand_trace_with_disk_experts():
    # the frequency plan above: disk L0e1, L1e0, L1e1 (+ the embedding: a 16 B row per token); host L0e2, L0e3
    p = plan(INV, offload_gb=gb(256 + 5 * UNIT), policy="frequency", stats=STATS, host_memory_gb=gb(2 * UNIT))
    rows = (TraceRow(0, 0, "prefill", ((1, 2), (0, 1))),
            TraceRow(0, 1, "decode", ((1, 2), (0, 2))),    # disk L0e1 L1e0, host L0e2, L1e2 resident
            TraceRow(0, 2, "decode", ((0, 1), (0, 3))),    # disk L0e1 L1e0
            TraceRow(0, 3, "decode", ((2, 3), (1, 2))))    # host L0e2 L0e3, disk L1e1
    trace = Trace(TraceHeader("qwen3_moe", 4, 2, (0, 1)), rows, "hand.jsonl")
    r = replay(p, trace)
    # host: 192 + 0 + 384 = 576; disk: 3 rows 48 + (384 + 384 + 192) = 1008; 3 + 2 + 3 expert reads
    assert (r.tokens, r.expert_reads) == (3, 8)
    assert (r.host_link_bytes_per_token, r.disk_read_bytes_per_token) == (576 / 3, 1008 / 3)
    assert r.link_bytes_per_token == (576 + 1008) / 3
    # an LRU cache of 10 experts: a repeat reads nothing from either tier. Hits: L0e1 and L1e0 at token 2,
    # L0e2 at token 3. Misses: host L0e2 (t1), L0e3 (t3); disk L0e1, L1e0 (t1), L1e1 (t3); rows are not cached.
    c = replay(p, trace, cache_gb=10 * UNIT / GiB, cache_policy="lru")
    assert (c.cache_hits, c.cache_misses) == (3, 5)
    assert (c.host_link_bytes_per_token, c.disk_read_bytes_per_token) == (2 * 192 / 3, (48 + 3 * 192) / 3)
    # a host cache alone holds the disk-tier experts, and the prefill (L0 e1 e2, L1 e0 e1) leaves its disk experts
    # L0e1, L1e0, L1e1 there (each layer's share: 5 experts): all 5 disk picks are read from host memory instead
    h = replay(p, trace, host_cache_gb=10 * UNIT / GiB, cache_policy="lru")
    assert (h.host_cache_hits, h.host_cache_misses) == (5, 0)
    assert (h.host_link_bytes_per_token, h.disk_read_bytes_per_token) == ((576 + 5 * 192) / 3, (1008 - 5 * 192) / 3)
    # without the prefill row, the decode steps' own repeats only: L0e1 and L1e0 at token 2
    bare = replay(p, Trace(trace.header, rows[1:], "hand.jsonl"), host_cache_gb=10 * UNIT / GiB, cache_policy="lru")
    assert (bare.host_cache_hits, bare.host_cache_misses) == (2, 3)
    assert (bare.host_link_bytes_per_token, bare.disk_read_bytes_per_token) == ((576 + 2 * 192) / 3,
                                                                                (1008 - 2 * 192) / 3)


# --- the command line ----------------------------------------------------------------------------------------
# The model of tests/test_cli_plan.py, a config.json alone: Qwen3-MoE float32, hidden 32, 2 layers, E=4, top-k 2.
#   embedding (128, 32) 16384 B (row 128 B); per layer gate_up_proj 16384 B (4 x 4096), down_proj 8192 B
#   (4 x 2048); all routed experts 49152 B; total 108288 B.

CONFIG = QWEN3_CONFIG
TOTAL = 108288


def arg(nbytes: int) -> str:
    return repr(nbytes / GiB)




@pytest.fixture
def folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    rows = [TraceRow(0, 0, "prefill", ((0, 1), (0, 1))), TraceRow(0, 1, "decode", ((0, 1), (2, 3))),
            TraceRow(0, 2, "decode", ((2, 3), (0, 3)))]
    write_trace(tmp_path / "trace.jsonl", TraceHeader("qwen3_moe", 4, 2, (0, 1), "test"), rows)
    return tmp_path


def test_cli_plan_device_cpu_puts_the_rest_on_disk_and_cuda_on_the_host(folder, capsys):
    # device 80000 B, no reserve: 28288 B must leave: the embedding 16384, then 11904 B of experts: the last 3
    # of L0 gate_up_proj's 4096 B experts (12288 B). On cpu all 28672 B go to disk; for cuda, to the host.
    common = ["plan", folder, "--device-memory", arg(80000 + GiB), "--reserve-gb", "1", "--json"]   # 1 GiB: the process
    rc, out, err = cli(capsys, *common, "--device", "cpu")
    assert rc == 0, err
    doc = json.loads(out)
    assert (doc["offloaded_bytes"], doc["disk_bytes"], doc["host_bytes"]) == (28672, 28672, 0)
    tiers = {t["name"]: t["tier"] for t in doc["tensors"] if t["tier"] != "device"}
    assert tiers == {"model.embed_tokens.weight": "disk", "model.layers.0.mlp.experts.gate_up_proj": "disk"}
    # per token: a row 128 B + 3 x 4096 x 1/2
    assert (doc["disk_read_bytes_per_token"], doc["host_link_bytes_per_token"]) == (128 + 6144, 0)
    assert any(n.startswith("CPU-only:") for n in doc["notes"])
    rc, out, _ = cli(capsys, *common, "--device", "cuda")
    doc = json.loads(out)
    assert rc == 0 and (doc["disk_bytes"], doc["host_bytes"], doc["host_budget_bytes"]) == (0, 28672, None)


def test_cli_host_memory_and_replay_by_hand(folder, capsys):
    # 65536 B leave (the embedding + every expert); host 32768 B: to disk 32768 B, the embedding and then the
    # first expert tensor that covers the 16384 B left, L0 gate_up_proj, whole. Host: L0 down, L1 gate_up + down.
    budget = ["--offload-gb", arg(65536), "--host-memory", arg(32768)]
    rc, out, err = cli(capsys, "plan", folder, *budget, "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert (doc["disk_bytes"], doc["host_bytes"], doc["host_budget_bytes"]) == (32768, 32768, 32768)
    rc, out, err = cli(capsys, "replay", folder / "config.json", "--trace", folder / "trace.jsonl", *budget, "--json")
    assert rc == 0, err
    r = json.loads(out)
    # token 1: L0 (0, 1): disk 2 x 4096, host 2 x 2048; L1 (2, 3): host 2 x 6144; + row 128 on disk
    # token 2: L0 (2, 3): the same bytes; L1 (0, 3): host 2 x 6144
    assert r["tokens"] == 2 and r["expert_reads"] == 8
    assert r["disk_read_bytes_per_token"] == 128 + 8192 and r["host_link_bytes_per_token"] == 4096 + 12288
    rc, out, _ = cli(capsys, "plan", folder, *budget)
    assert rc == 0 and "host: 32.00 KiB   disk: 32.00 KiB" in out and "from disk" in out


@pytest.mark.parametrize("argv, message", [
    (["plan", "{m}", "--offload-gb", "0.00001", "--host-memory", "-1"], "error: --host-memory -1.0 is not a size"),
    (["plan", "{m}", "--host-memory", "1"], "error: --host-memory 1 sizes the host tier for what leaves the device"),
    (["plan", "{m}", "--offload-gb", "0.00001", "--host-memory", "0.1", "--device", "nonsense"],
     "error: --device 'nonsense' is not a device name"),
    (["replay", "{m}/config.json", "--trace", "{m}/trace.jsonl", "--plan", "{m}/p.json", "--host-memory", "1"],
     "error: --plan and --host-memory both decide the placement"),
    (["export", "{m}", "--engine", "vllm", "--plan", "{m}/p.json", "--host-memory", "1"],
     "error: --plan and --host-memory both decide the placement"),
])
def test_cli_errors_exit_2(folder, capsys, argv, message):
    (folder / "p.json").write_text(plan(INV).to_json())
    rc, out, err = cli(capsys, *[a.format(m=folder) for a in argv])
    assert rc == 2 and out == "" and err.count("\n") == 1 and err.startswith(message), err


def test_cli_host_too_small_for_what_cannot_go_to_disk(family_dir, capsys):
    # deepseek_v3 keeps a persistent router buffer (e_score_correction_bias): it never goes to disk
    d = family_dir("deepseek_v3")
    total = mo.plan(d).total_bytes
    rc, out, err = cli(capsys, "plan", d, "--offload-gb", arg(total), "--host-memory", "0")
    assert rc == 2 and out == "" and err.startswith("error: host memory too small:")
    assert "give --host-memory " in err and "buffers are not read from the checkpoint" in err


def test_plan_table_shows_host_and_disk_columns():
    import io

    from rich.console import Console

    from moe_offload.cli.report import print_plan

    console = Console(file=io.StringIO(), width=200)
    print_plan(plan(ONE, offload_gb=gb(448), host_memory_gb=gb(100)), console)
    text = console.file.getvalue()
    header = next(line for line in text.splitlines() if "role" in line)
    assert [c.strip() for c in header.split("┃")[1:-1]] == ["role", "params", "bytes", "host", "disk",
                                                            "share offloaded"]
    assert "host: 0 B   disk: 448 B" in text and "(0 B from host memory, 112 B from disk)" in text
    row = next(line for line in text.splitlines() if line.startswith("│ routed_expert"))
    assert [c.strip() for c in row.split("│")[3:6]] == ["768 B", "0 B", "192 B"]

