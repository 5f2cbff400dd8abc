"""`--lookahead N` and `--disk-read mmap` on generate and bench: the look-ahead and the memory-mapped disk tier
from the command line.

Model: make_tiny qwen3_moe, float32, hidden 32, 4 layers, E=8, top-2 (775,552 B). The budget is CPU-only
(`--device cpu --device-memory` a third of the model, `--reserve-gb 0`): the embedding and most routed experts
are read from the checkpoint at every use.

What is checked: generate --json reports the look-ahead (distance, hits + misses, recall by layer) and decodes
the tokens of --lookahead 0; --disk-read mmap decodes them too with the same disk bytes and says mmap; bench rows
carry the look-ahead fields; a negative distance exits 2 with one `error:` line.
"""

from __future__ import annotations


import pytest

import moe_offload as mo
from fixtures_cli import cli_json, run_cli
from moe_offload.planning.placement import GiB, Tier
from moe_offload.tiny.make import make_tiny

LAYERS = 4
PROMPT = "The storm reached the coast"
NEW = 8
FIELDS = ("lookahead", "lookahead_hits", "lookahead_misses", "lookahead_wasted_bytes_per_token",
          "lookahead_cancelled_bytes_per_token", "lookahead_recall")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("cli-lookahead") / "m", family="qwen3_moe", layers=LAYERS, experts=8,
                     top_k=2, hidden=32)


@pytest.fixture(scope="module")
def budget(model_dir) -> list[str]:
    total = mo.plan(model_dir, offload_gb=0).total_bytes
    plan = mo.plan(model_dir, device_memory_gb=total // 3 / GiB + 1, reserve_gb=1, cpu_only=True)
    assert sum(t.tier == Tier.DISK for t in plan.tensors if t.role == "routed_expert") >= LAYERS
    return ["--device", "cpu", "--device-memory", repr(total // 3 / GiB + 1), "--reserve-gb", "1"]


def _generate(capsys, model_dir, budget, *extra) -> dict:
    return cli_json(capsys, "generate", model_dir, "--prompt", PROMPT, "--max-new-tokens", NEW, "--ignore-eos",
                 *budget, *extra, "--json")


def test_generate_reports_the_lookahead_and_the_same_tokens(capsys, model_dir, budget):
    off = _generate(capsys, model_dir, budget, "--lookahead", 0)
    on = _generate(capsys, model_dir, budget, "--lookahead", 1)
    assert len(off["token_ids"]) == NEW and on["token_ids"] == off["token_ids"]
    assert on["disk_read_bytes_per_token"] == off["disk_read_bytes_per_token"] > 0   # when, never what
    assert (off["lookahead"], off["lookahead_hits"], off["lookahead_misses"], off["lookahead_recall"]) == \
        (0, 0, 0, {})
    assert on["lookahead"] == 1 and on["lookahead_hits"] + on["lookahead_misses"] > 0
    assert on["lookahead_wasted_bytes_per_token"] >= 0
    recall = on["lookahead_recall"]
    assert isinstance(recall, dict) and recall and set(recall) <= {str(layer) for layer in range(LAYERS)}
    assert all(r is None or 0 <= r <= 1 for r in recall.values())
    assert recall.get("0") in (0, None)            # layer 0 has no earlier layer to predict it from
    two = _generate(capsys, model_dir, budget, "--lookahead", 2)
    assert two["lookahead"] == 2 and two["token_ids"] == off["token_ids"]
    early = _generate(capsys, model_dir, budget, "--lookahead", 1, "--lookahead-from", "attention")
    assert early["token_ids"] == off["token_ids"] and early["disk_read_bytes_per_token"] == off["disk_read_bytes_per_token"]
    assert (early["lookahead_from"], on["lookahead_from"], off["lookahead_from"]) == ("attention", "output", None)
    assert early["lookahead_hits"] + early["lookahead_misses"] > 0


def test_disk_read_mmap_gives_the_same_tokens_and_bytes(capsys, model_dir, budget):
    direct = _generate(capsys, model_dir, budget)
    mapped = _generate(capsys, model_dir, budget, "--disk-read", "mmap")
    assert mapped["token_ids"] == direct["token_ids"]
    assert mapped["disk_read_bytes_per_token"] == direct["disk_read_bytes_per_token"] > 0
    assert "mmap" in mapped["disk_read_mechanism"] and "mmap" not in direct["disk_read_mechanism"]
    both = _generate(capsys, model_dir, budget, "--disk-read", "mmap", "--lookahead", 1)
    assert both["token_ids"] == direct["token_ids"] and both["lookahead"] == 1


def test_bench_rows_carry_the_lookahead(capsys, model_dir, budget):
    rows = cli_json(capsys, "bench", model_dir, *budget, "--lookahead", 1, "--arms", "sparse-first", "--runs", 1,
                 "--max-new-tokens", 4, "--concurrency", 1, "--json", "-")
    (row,) = rows
    assert row["arm"] == "sparse-first" and all(f in row for f in FIELDS), sorted(row)
    assert row["lookahead"] == 1 and row["lookahead_hits"] + row["lookahead_misses"] > 0
    assert isinstance(row["lookahead_recall"], dict) and row["lookahead_recall"]


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_a_negative_lookahead_exits_2(capsys, model_dir, budget, command):
    extra = {"generate": ["--prompt", PROMPT],
             "bench": ["--arms", "sparse-first", "--runs", 1, "--max-new-tokens", 2, "--concurrency", 1]}[command]
    try:
        rc, out, err = run_cli(capsys, command, model_dir, *extra, *budget, "--lookahead", "-1")
    except Exception as exc:   # a user error must never end in a traceback
        pytest.fail(f"{command} --lookahead -1 raised {exc!r} instead of exiting 2")
    assert rc == 2 and out == "" and err.startswith("error: ") and err.count("\n") == 1, (rc, err)
    assert "lookahead" in err


@pytest.mark.parametrize("backend", ["uva", "prefetch"])
def test_generate_looks_ahead_for_host_tier_experts(capsys, model_dir, backend):
    """No disk tier: the host-tier experts are copied ahead (CPU-only: on a worker thread); same tokens and bytes."""
    host = ["--device", "cpu", "--offload-gb", "0.0005", "--backend", backend]
    off = _generate(capsys, model_dir, host)
    on = _generate(capsys, model_dir, host, "--lookahead", 1)
    assert off["disk_read_bytes_per_token"] == 0 and off["link_bytes_per_token"] > 0
    assert on["token_ids"] == off["token_ids"] and on["link_bytes_per_token"] == off["link_bytes_per_token"]
    assert on["lookahead"] == 1 and on["lookahead_hits"] > 0
    assert on["lookahead_cancelled_bytes_per_token"] == 0          # host copies are never dropped
    assert off["lookahead_cancelled_bytes_per_token"] == off["lookahead_wasted_bytes_per_token"] == 0
