"""The device-side expert cache in the runtime (`load(cache_gb=..., cache_policy=...)`, `--cache-gb`).

Models: fixtures_models (E=6 experts, top-2, 2 layers, float32): one expert is 12,288 B of gate_up_proj +
6,144 B of down_proj = 18,432 B per layer (gpt-oss adds its biases: 384 + 128 B, 18,944 B); pages are the gcd
of the row sizes (6,144 B; 128 B for gpt-oss). A cache of one expert's bytes cannot hold one layer's two picks.

What is checked: outputs bit-identical to the plain model with a cache too small for one layer's picks and
one larger than every offloaded expert (every family, both backends); the runtime's hits, misses and link
bytes on a generation == replay's on that generation's own trace (each online policy, both backends, and a
placement whose experts have different sizes); capacity in bytes; update_weights / transform_weights drop
stale copies; belady and bad sizes refused (exit 2 on the command line); reports of generate and bench.
"""

from __future__ import annotations

import json

import pytest
import torch

import moe_offload as mo
from fixtures_models import BACKENDS, EXPERTS, FAMILIES, budgets, prompt_ids, reference_model, subset_plan
from moe_offload.routing.cache_policy import DEFAULT_CACHE_POLICY, cache_policy_names
from moe_offload.cli.main import main
from moe_offload.errors import BudgetError, SelectorError
from moe_offload.loading.loader import load_tokenizer
from moe_offload.planning.placement import GiB, Plan
from moe_offload.measure.profile import record, trace_header
from moe_offload.routing.replay import replay
from moe_offload.formats.traces import TraceWriter, read_trace

pytestmark = pytest.mark.exact

PROMPTS = ["The harbour master counted seven ships", "Rain fell on the quiet valley all night long"]
NEW = 6


def run(model, ids: torch.Tensor, new_tokens: int = NEW):
    """fixtures_models.run with EOS ignored (some tiny models pick EOS first: the cache needs decode steps):
    (greedy tokens [1, n+new], per-step logits [new, V], prefill logits [1, n, V])."""
    mask = torch.ones_like(ids)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, eos_token_id=[],
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        prefill = model(input_ids=ids, attention_mask=mask).logits
    assert out.sequences.shape[1] == ids.shape[1] + new_tokens
    return out.sequences, torch.cat(out.logits), prefill


@pytest.fixture(scope="module")
def references(models):
    """family -> (tokens, step logits, prefill logits) of the plain transformers model, computed once."""
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = run(reference_model(models[family], family), prompt_ids(models[family], 8), NEW)
        return cache[family]

    return get


def expert_bytes(plan: Plan) -> list[int]:
    """Offloaded bytes of every (layer, expert) that has any, from the plan's sizes alone."""
    tb = plan.token_bytes()
    return [int(b) for b in (tb.expert_host + tb.expert_disk).ravel() if b]


def _load(folder, cache_bytes, backend="uva", **kw):
    return mo.load(folder, device="cpu", backend=backend, cache_gb=cache_bytes / GiB, **kw)


def _equal(got, want) -> bool:
    return all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


# gpt-oss, per tensor its own host experts in layer 1 (expert 4 in all four, 0 in two, 1 in one ...), all of
# layer 0's experts 2 and 3: experts of five different sizes; one bias stays resident.
MIXED = {"gate_up_proj": (1, 4), "gate_up_proj_bias": (0, 1, 2, 3, 4, 5), "down_proj": (0, 2, 4),
         "down_proj_bias": None}


def mixed_plan(folder) -> Plan:
    return subset_plan(folder, lambda t: MIXED[t.name.rpartition(".")[2]] if t.layer == 1 else (2, 3))


# --- equality with the plain model -------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_outputs_equal_the_plain_model_with_a_small_and_a_large_cache(models, plans0, references, family, backend):
    folder = models[family]
    plan = mo.plan(folder, **budgets(plans0(family))["sparse-first"])   # every routed expert offloaded
    sizes = expert_bytes(plan)
    assert sizes and len(sizes) % EXPERTS == 0
    # One expert's bytes: top-2 picks never fit together, so the policy declines or evicts every step.
    model, _ = _load(folder, max(sizes), backend, plan=plan)
    assert _equal(run(model, prompt_ids(folder, 8), NEW), references(family))
    stats = model.moe_offload_runtime.cache.stats()
    assert stats["cache_misses"] > 0 and stats["cache_declined"] + stats["cache_evictions"] > 0
    assert stats["cache_device_bytes"] == max(sizes) == stats["cache_bytes"]
    # Larger than every offloaded expert together: only what they need is carved, nothing is ever evicted.
    model, _ = _load(folder, sum(sizes) + 12345, backend, plan=plan)
    assert _equal(run(model, prompt_ids(folder, 8), NEW), references(family))
    stats = model.moe_offload_runtime.cache.stats()
    assert stats["cache_hits"] > 0 and stats["cache_evictions"] == stats["cache_declined"] == 0
    assert stats["cache_device_bytes"] == sum(sizes) and stats["cache_bytes"] == sum(sizes) + 12345


@pytest.mark.parametrize("backend", BACKENDS)
def test_experts_of_different_sizes_share_one_arena_of_pages(models, references, backend):
    folder = models["gpt_oss"]
    plan = mixed_plan(folder)
    sizes = expert_bytes(plan)
    assert len(set(sizes)) == 5
    model, _ = _load(folder, 2 * max(sizes) + 300, backend, plan=plan, cache_policy="lru")   # evicts often
    cache = model.moe_offload_runtime.cache
    assert cache.page_bytes == 128
    assert _equal(run(model, prompt_ids(folder, 8), NEW), references("gpt_oss"))
    assert cache.policy.hits > 0 and cache.policy.evictions > 0


# --- the runtime decides as replay does ----------------------------------------------------------------------


def _generate_with_trace(folder, plan, cache_bytes, policy, backend, path):
    model, plan = _load(folder, cache_bytes, backend, plan=plan, cache_policy=policy)
    runtime = model.moe_offload_runtime
    runtime.counter.reset()
    with TraceWriter(path, trace_header(plan, "cache test")) as writer:
        record(model, load_tokenizer(folder), PROMPTS, writer, max_new_tokens=NEW, ignore_eos=True)
    return runtime, read_trace(path)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("policy", cache_policy_names())
def test_hits_misses_and_link_bytes_equal_replay_of_the_generations_own_trace(models, plans0, tmp_path, policy,
                                                                              backend):
    folder = models["qwen3_moe"]
    plan = mo.plan(folder, **budgets(plans0("qwen3_moe"))["sparse-first"])
    capacity = 4 * 18432 + 1000          # a third of the 12 offloaded experts: hits, evictions (and declines)
    runtime, trace = _generate_with_trace(folder, plan, capacity, policy, backend, tmp_path / "own.jsonl")
    want = replay(plan, trace, cache_gb=capacity / GiB, cache_policy=policy)
    stats = runtime.cache.stats()
    assert want.tokens == 2 * NEW and want.cache_policy == policy == stats["cache_policy"]
    assert (stats["cache_hits"], stats["cache_misses"]) == (want.cache_hits, want.cache_misses)
    assert stats["cache_hits"] > 0 and stats["cache_evictions"] > 0
    assert runtime.counter.decode_bytes_per_token() == want.link_bytes_per_token
    without = replay(plan, trace)
    assert want.link_bytes_per_token < without.link_bytes_per_token   # the hits read nothing


@pytest.mark.parametrize("backend", BACKENDS)
def test_runtime_equals_replay_with_experts_of_different_sizes(models, tmp_path, backend):
    folder = models["gpt_oss"]
    plan = mixed_plan(folder)
    capacity = 2 * max(expert_bytes(plan)) + 777
    runtime, trace = _generate_with_trace(folder, plan, capacity, None, backend, tmp_path / "own.jsonl")
    want = replay(plan, trace, cache_gb=capacity / GiB)
    assert want.cache_policy == DEFAULT_CACHE_POLICY == runtime.cache.policy_name
    assert (runtime.cache.policy.hits, runtime.cache.policy.misses) == (want.cache_hits, want.cache_misses)
    assert runtime.counter.decode_bytes_per_token() == want.link_bytes_per_token


# --- capacity -------------------------------------------------------------------------------------------------


def test_capacity_in_bytes_is_exact_and_never_exceeded(models, plans0):
    folder = models["qwen3_moe"]
    # layer 0 whole on the host, layer 1 gate_up_proj of experts 2..5 only: experts of 18,432 and 12,288 B
    plan = subset_plan(folder, lambda t: range(EXPERTS) if t.layer == 0 else
                       (2, 3, 4, 5) if t.name.endswith("gate_up_proj") else None)
    assert sorted(expert_bytes(plan)) == [12288] * 4 + [18432] * 6
    capacity = 2 * 18432 + 6143           # 43,007 B: 6 whole pages of 6,144 B, and 6,143 B no expert could use
    model, _ = _load(folder, capacity, "prefetch", plan=plan, cache_policy="lru")
    cache = model.moe_offload_runtime.cache
    assert cache.capacity_bytes == capacity and cache.page_bytes == 6144
    assert cache.device_bytes == cache.arena.numel() == 6 * 6144 <= capacity
    seen = []   # after each layer step: (bytes of the pages held, the policy's used bytes)
    decide = cache.decide

    def checked(*args):
        staged = decide(*args)
        seen.append((sum(len(p) for pages in cache._pages.values() for p in pages) * 6144, cache.policy.used_bytes))
        return staged

    cache.decide = checked
    run(model, prompt_ids(folder, 8), NEW)
    assert len(seen) == 2 * (NEW - 1) and all(pages == used <= capacity for pages, used in seen)
    assert {used for _, used in seen} >= {18432 + 12288, 2 * 18432}   # full with either mix of sizes
    assert len(cache._free) + sum(len(p) for pages in cache._pages.values() for p in pages) == 6


def test_a_cache_of_0_or_none_changes_nothing(models, plans0):
    folder = models["qwen3_moe"]
    plan = mo.plan(folder, **budgets(plans0("qwen3_moe"))["sparse-first"])
    counts = []
    for kw in ({}, {"cache_gb": 0}, {"cache_gb": 0, "cache_policy": "lru"}):
        model, _ = mo.load(folder, device="cpu", plan=plan, **kw)
        runtime = model.moe_offload_runtime
        assert runtime.cache is None
        run(model, prompt_ids(folder, 8), NEW)
        counts.append(runtime.counter.calls)
    assert counts[0] == counts[1] == counts[2]


def test_a_cache_smaller_than_one_expert_is_refused_before_loading(models, plans0, monkeypatch):
    from moe_offload.loading import loader

    folder = models["qwen3_moe"]
    plan = mo.plan(folder, **budgets(plans0("qwen3_moe"))["sparse-first"])
    monkeypatch.setattr(loader, "stream_checkpoint", lambda *a: pytest.fail("weights were read"))
    with pytest.raises(BudgetError, match=r"cannot hold one expert: expert 0 of layer 0 has 18432 offloaded bytes"):
        _load(folder, 18431, plan=plan)


# --- weights written after load -----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_update_weights_invalidates_the_cached_copies_of_what_it_changes(models, plans0, backend):
    family = "qwen3_moe"
    folder = models[family]
    plan = mo.plan(folder, **budgets(plans0(family))["sparse-first"])
    model, _ = _load(folder, 100 * 18432, backend, plan=plan)
    cache = model.moe_offload_runtime.cache
    ids = prompt_ids(folder, 8)
    run(model, ids, NEW)
    before = cache.contents()
    assert {layer for layer, _ in before} == {0, 1}
    name = "model.layers.1.mlp.experts.down_proj"
    new = torch.randn(EXPERTS, 32, 48, generator=torch.Generator().manual_seed(3)) * 0.1
    mo.update_weights(model, {name: new})
    assert cache.contents() == {key for key in before if key[0] == 0}   # layer 1's copies gone, layer 0's kept
    reference = reference_model(folder, family)
    with torch.no_grad():
        reference.get_parameter(name).copy_(new)
    # Run twice: the second run hits on what the first one cached of the new weights.
    assert _equal(run(model, ids, NEW), run(reference, ids, NEW))
    assert _equal(run(model, ids, NEW), run(reference, ids, NEW))
    assert cache.policy.hits > 0


def test_transform_weights_leaves_no_stale_copy(models, plans0, references):
    family = "qwen3_moe"
    folder = models[family]
    plan = mo.plan(folder, **budgets(plans0(family))["sparse-first"])
    model, _ = _load(folder, 100 * 18432, "prefetch", plan=plan)
    cache = model.moe_offload_runtime.cache
    arena = cache.arena
    ids = prompt_ids(folder, 8)
    run(model, ids, NEW)
    assert cache.contents()
    transpose = lambda n, w: w.transpose(-1, -2).contiguous()   # noqa: E731 - expert by expert
    name = "model.layers.0.mlp.experts.gate_up_proj"
    mo.transform_weights(model, transpose, names=[name])
    assert not cache.contents() and cache.arena is arena          # dropped; same row sizes: not carved again
    mo.transform_weights(model, transpose, names=[name])
    assert _equal(run(model, ids, NEW), references(family))


# --- refused options --------------------------------------------------------------------------------------------


def test_belady_is_refused_by_the_runtime(models):
    with pytest.raises(SelectorError, match="offline optimum.*only `replay` has"):
        mo.load(models["qwen3_moe"], device="cpu", offload_gb=0.0003, cache_gb=0.001, cache_policy="belady")


def _cli(capsys, *argv):
    code = main(list(map(str, argv)))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("options, message", [
    (["--cache-gb", "-1"], "--cache-gb -1.0 is not a size"),
    (["--cache-gb", "nan"], "--cache-gb nan is not a size"),
    (["--cache-gb", "1e-9"], "cannot hold one expert"),
    (["--cache-policy", "lru"], "--cache-policy lru without --cache-gb"),
    (["--cache-gb", "0.001", "--cache-policy", "nope"], "unknown cache policy 'nope'"),
    (["--cache-gb", "0.001", "--cache-policy", "belady"], "only `replay` has"),
])
def test_bad_cache_options_exit_2(capsys, models, options, message):
    code, out, err = _cli(capsys, "generate", models["qwen3_moe"], "--prompt", "The river", "--offload-gb", "0.0003",
                          "--device", "cpu", *options)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("error:") and message in err


def test_with_device_memory_the_cache_comes_out_of_the_reserve(capsys, models, plans0):
    folder = models["qwen3_moe"]
    total = plans0("qwen3_moe").total_bytes
    budget = dict(device_memory_gb=(total // 2 + (1 << 20)) / GiB, reserve_gb=(1 << 20) / GiB)   # 1 MiB reserve
    model, plan = _load(folder, 1 << 19, plan=None, **budget)
    note = [n for n in plan.notes if "expert cache" in n]
    assert note == ["the device-side expert cache (512.00 KiB, heat) is taken out of the 0.000976562 GiB reserve: "
                    "512.00 KiB of it remain for activations and the KV cache"]
    assert plan.offloaded_bytes > 0 and model.moe_offload_runtime.cache.capacity_bytes == 1 << 19
    with pytest.raises(BudgetError, match="does not fit in the 0.000976562 GiB reserve"):
        _load(folder, (1 << 20) + 1, **budget)
    # the CLI on this CPU: its reserve also holds the process itself (1 GiB more, measured far below): a cache larger
    # than that reserve does not fit
    code, out, err = _cli(capsys, "generate", folder, "--prompt", "x", "--device", "cpu", "--device-memory",
                          budget["device_memory_gb"] + 1, "--reserve-gb", budget["reserve_gb"] + 1, "--cache-gb", 1.002)
    assert code == 2 and err.startswith("error: --cache-gb 1.002 does not fit") and "--reserve-gb" in err
    # one that fits in the reserve alone but not beside the process itself is refused too, naming it
    code, out, err = _cli(capsys, "generate", folder, "--prompt", "x", "--device", "cpu", "--device-memory",
                          budget["device_memory_gb"] + 1, "--reserve-gb", budget["reserve_gb"] + 1, "--cache-gb", 0.9)
    assert code == 2 and "does not fit" in err and "beside the process itself" in err, err


# --- reports ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_generate_json_reports_the_cache(capsys, models, backend):
    folder = models["qwen3_moe"]
    common = ["generate", folder, "--prompt", "The river", "--max-new-tokens", NEW, "--ignore-eos", "--device", "cpu",
              "--offload-gb", 0.0003, "--backend", backend, "--json"]
    code, out, _ = _cli(capsys, *common)
    plain = json.loads(out)
    assert code == 0 and (plain["cache_policy"], plain["cache_bytes"], plain["cache_hits"]) == (None, 0, 0)
    code, out, _ = _cli(capsys, *common, "--cache-gb", 100 * 18432 / GiB, "--cache-policy", "lfu")
    cached = json.loads(out)
    assert code == 0 and cached["token_ids"] == plain["token_ids"]
    assert (cached["cache_policy"], cached["cache_bytes"]) == ("lfu", 100 * 18432)
    assert cached["cache_hits"] > 0 and cached["cache_misses"] > 0
    assert cached["link_bytes_per_token"] < plain["link_bytes_per_token"]


def test_bench_gives_every_arm_the_same_cache_and_reports_it(models):
    from moe_offload.measure.bench import run_bench

    folder = models["qwen3_moe"]
    options = dict(concurrency=[1], max_new_tokens=4, offload_gb=0.0002, device="cpu", cache_gb=100 * 18432 / GiB,
                   cache_policy="lru", log=lambda msg: None)
    rows = run_bench(folder, arms="declaration,sparse-first", runs=2, **options)
    assert [r["arm"] for r in rows] == ["declaration", "sparse-first"]
    for row in rows:
        assert (row["cache_policy"], row["cache_bytes"]) == ("lru", 100 * 18432)
        cache = row["settings"]["cache"]
        assert (cache["policy"], cache["bytes"]) == ("lru", 100 * 18432) and 0 <= cache["device_bytes"] <= 100 * 18432
        assert row["device_bytes"] >= cache["device_bytes"]
    # Each run starts cold (warm-up included): two measured runs count twice what one run counts.
    (one,) = run_bench(folder, arms="sparse-first", runs=1, **options)
    assert one["cache_hits"] > 0 and one["cache_misses"] > 0
    assert (rows[1]["cache_hits"], rows[1]["cache_misses"]) == (2 * one["cache_hits"], 2 * one["cache_misses"])
