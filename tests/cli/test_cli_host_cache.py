"""`--host-cache-gb` on generate, replay and bench: the host-memory cache of disk-tier experts from the command line.

Model: make_tiny qwen3_moe at fixtures_models.SIZES (float32, hidden 32, 2 layers, E=6, top-2; one expert 18,432 B
per layer, 379,136 B in all). The budget is CPU-only (`--device cpu --device-memory`, a third of the model, with a
reserve of 5 experts): the embedding and every routed expert are read from disk. The host cache (4 experts) is
carved out of that reserve, by generate, bench and replay alike.

What is checked: generate --json reports the host cache and decodes the tokens of the same budget without it;
replay of the trace `moe-offload profile` records for the same prompt gives generate's disk and host bytes per
token and its hits and misses; bench rows carry the host cache's counts; a size that is no size exits 2 with one
`error:` line naming --host-cache-gb.
"""

from __future__ import annotations


import pytest

import moe_offload as mo
from fixtures_cli import cli_json, run_cli
from fixtures_models import SIZES
from moe_offload.planning.placement import GiB, Tier
from moe_offload.tiny.make import make_tiny

EXPERT = 18432
CACHE = 4 * EXPERT
PROMPT = "The storm reached the coast"
NEW = 8      # generate's tokens: the first from the prefill, then NEW - 1 decode steps


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("cli-host-cache") / "m", family="qwen3_moe", **SIZES)


@pytest.fixture(scope="module")
def budget(model_dir) -> list[str]:
    total = mo.plan(model_dir, offload_gb=0).total_bytes
    options = ["--device", "cpu", "--device-memory", repr(total // 3 / GiB + 1), "--reserve-gb", repr(1 + 5 * EXPERT / GiB)]
    # with or without the carve (the reserve is the room beside the weights), every routed expert is on disk
    for reserve in (5, 1):
        p = mo.plan(model_dir, device_memory_gb=total // 3 / GiB + 1, reserve_gb=1 + reserve * EXPERT / GiB,
                    cpu_only=True)
        assert all(t.tier == Tier.DISK for t in p.tensors if t.role == "routed_expert")
    return options


def _generate(capsys, model_dir, budget, *extra) -> dict:
    return cli_json(capsys, "generate", model_dir, "--prompt", PROMPT, "--max-new-tokens", NEW, "--ignore-eos",
                 *budget, *extra, "--json")


def test_generate_reports_the_host_cache_and_the_same_tokens(capsys, model_dir, budget):
    from moe_offload.routing.cache_policy import DEFAULT_CACHE_POLICY

    plain = _generate(capsys, model_dir, budget)
    cached = _generate(capsys, model_dir, budget, "--host-cache-gb", repr(CACHE / GiB))
    assert cached["token_ids"] == plain["token_ids"] and len(plain["token_ids"]) == NEW
    assert (plain["host_cache_policy"], plain["host_cache_bytes"], plain["host_cache_hits"]) == (None, 0, 0)
    assert (cached["host_cache_policy"], cached["host_cache_bytes"]) == (DEFAULT_CACHE_POLICY, CACHE)
    assert cached["host_cache_hits"] + cached["host_cache_misses"] > 0
    # what the cache served came from host memory, not the disk
    assert cached["disk_read_bytes_per_token"] < plain["disk_read_bytes_per_token"]
    assert cached["host_link_bytes_per_token"] > plain["host_link_bytes_per_token"] == 0
    lfu = _generate(capsys, model_dir, budget, "--host-cache-gb", repr(CACHE / GiB), "--cache-policy", "lfu")
    assert lfu["host_cache_policy"] == "lfu" and lfu["cache_policy"] is None and lfu["token_ids"] == plain["token_ids"]


@pytest.mark.parametrize("policy", [None, "lru"])
def test_replay_of_the_profiled_trace_gives_generates_bytes(capsys, model_dir, budget, tmp_path, policy):
    chosen = ["--cache-policy", policy] if policy else []
    cache = ["--host-cache-gb", repr(CACHE / GiB), *chosen]
    ran = _generate(capsys, model_dir, budget, *cache)
    prompts, trace = tmp_path / "prompts.txt", tmp_path / "trace.jsonl"
    prompts.write_text(PROMPT + "\n")
    # profile records its own decode steps: NEW - 1 of them are generate's
    rc, _, err = run_cli(capsys, "profile", model_dir, "--out", trace, "--prompts", prompts, "--max-new-tokens",
                         NEW - 1, "--ignore-eos", "--device", "cpu")
    assert rc == 0, err
    doc = cli_json(capsys, "replay", model_dir, "--trace", trace, *budget, *cache, "--json")
    assert doc["tokens"] == NEW - 1
    assert (doc["host_cache_policy"], doc["host_cache_bytes"]) == (ran["host_cache_policy"], CACHE)
    assert doc["disk_read_bytes_per_token"] == ran["disk_read_bytes_per_token"]
    assert doc["host_link_bytes_per_token"] == ran["host_link_bytes_per_token"]
    assert (doc["host_cache_hits"], doc["host_cache_misses"]) == (ran["host_cache_hits"], ran["host_cache_misses"])
    assert doc["host_cache_hits"] > 0


def test_bench_rows_carry_the_host_cache(capsys, model_dir, budget):
    from moe_offload.routing.cache_policy import DEFAULT_CACHE_POLICY

    rows = cli_json(capsys, "bench", model_dir, *budget, "--host-cache-gb", repr(CACHE / GiB), "--arms", "sparse-first",
                 "--runs", 1, "--max-new-tokens", 4, "--concurrency", 1, "--json", "-")
    (row,) = rows
    assert row["arm"] == "sparse-first"
    assert (row["host_cache_bytes"], row["host_cache_policy"]) == (CACHE, DEFAULT_CACHE_POLICY)
    assert row["host_cache_hits"] + row["host_cache_misses"] > 0
    assert row["host_cache_misses"] > 0      # a measured run starts cold: the first uses miss


@pytest.mark.parametrize("command", ["generate", "replay", "bench"])
@pytest.mark.parametrize("size", ["-1", "nan"])
def test_a_host_cache_size_that_is_no_size_exits_2(capsys, model_dir, budget, tmp_path, command, size):
    from moe_offload.formats.traces import TraceHeader, TraceRow, write_trace

    trace = tmp_path / "trace.jsonl"
    write_trace(trace, TraceHeader("qwen3_moe", 6, 2, (0, 1)), [TraceRow(0, 1, "decode", ((0, 1), (2, 3)))])
    extra = {"generate": ["--prompt", PROMPT], "replay": ["--trace", trace],
             "bench": ["--arms", "sparse-first", "--runs", 1, "--max-new-tokens", 2, "--concurrency", 1]}[command]
    try:
        rc, out, err = run_cli(capsys, command, model_dir, *extra, *budget, "--host-cache-gb", size)
    except Exception as exc:   # a user error must never end in a traceback
        pytest.fail(f"{command} --host-cache-gb {size} raised {exc!r} instead of exiting 2")
    assert rc == 2 and out == "" and err.startswith("error: ") and err.count("\n") == 1, (rc, err)
    assert "--host-cache-gb" in err and "not a size" in err, err
