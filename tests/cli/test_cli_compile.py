"""`--compile` (and `--experts`) on generate and bench through the CLI entry point.

generate --compile --json reports compile true, compile_s (the first step's time beyond a warm one) and the
experts mode asked for, with the tokens of the same command uncompiled wherever the uncompiled run's top-1/top-2
logit margin leaves no doubt (the margins are computed here, and the rule must have checked most tokens);
families without a static KV cache exit 2 with one `error:` line; bench rows carry compile and compile_s.

Model: make_tiny qwen3_moe (2 layers, hidden 64, 8 experts top-2, float32); the budget offloads the embedding and
5/8 of the routed-expert bytes, so one tensor is split by expert (its gather breaks the compiled graph).
Three compiled runs in this file (inductor builds C++: ~10 s each on 2 cores).
"""

from __future__ import annotations

import json

import pytest
import torch

import moe_offload as mo
from fixtures_cli import run_cli
from moe_offload.loading.loader import load_tokenizer
from moe_offload.planning.placement import GiB
from moe_offload.tiny.make import make_tiny

SIZES = dict(layers=2, experts=8, hidden=64)
PROMPT = "The river"
NEW = 6
MARGIN = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("cli-compile") / "m", family="qwen3_moe", **SIZES)


@pytest.fixture(scope="module")
def split_gb(model_dir) -> float:
    p0 = mo.plan(model_dir, offload_gb=0)
    embed = sum(t.bytes for t in p0.tensors if t.role == "embedding")
    routed = sum(t.bytes for t in p0.tensors if t.role == "routed_expert")
    gb = (embed + routed * 5 // 8) / GiB
    assert any(0 < t.host_experts < t.shape[0] for t in mo.plan(model_dir, offload_gb=gb).tensors)
    return gb


def _reference(model_dir, gb: float, experts: str):
    """(tokens, per-token top-1 minus top-2 logit) of the uncompiled model the command loads."""
    model, _ = mo.load(model_dir, device="cpu", offload_gb=gb, experts=experts)
    enc = load_tokenizer(model_dir)(PROMPT, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=NEW, do_sample=False, eos_token_id=[], output_logits=True,
                             return_dict_in_generate=True)
    top = torch.cat(out.logits).float().topk(2, dim=-1).values
    return out.sequences[0, enc["input_ids"].shape[1]:].tolist(), (top[:, 0] - top[:, 1]).tolist()


def _json(capsys, *argv) -> dict:
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 0, err
    return json.loads(out)


@pytest.mark.parametrize("experts", ["grouped", "eager"])
def test_generate_compile_reports_it_and_keeps_the_tokens(capsys, model_dir, split_gb, experts):
    argv = ("generate", model_dir, "--prompt", PROMPT, "--max-new-tokens", NEW, "--ignore-eos", "--device", "cpu",
            "--offload-gb", split_gb, "--experts", experts, "--json")
    plain = _json(capsys, *argv)
    compiled = _json(capsys, *argv, "--compile")
    assert plain["compile"] is False and compiled["compile"] is True
    assert plain["experts"] == compiled["experts"] == experts
    assert isinstance(compiled["compile_s"], float) and compiled["compile_s"] >= 0
    # uncompiled, only the grouped kernels compile
    assert (plain["compile_s"] is None) == (experts == "eager")
    ref_tokens, margins = _reference(model_dir, split_gb, experts)
    assert plain["token_ids"] == ref_tokens and len(compiled["token_ids"]) == NEW
    checked = 0
    for i, margin in enumerate(margins):   # past a near tie the two histories may part
        if margin <= MARGIN:
            break
        assert compiled["token_ids"][i] == ref_tokens[i], f"token {i} differs at reference margin {margin:.2e}"
        checked += 1
    assert checked >= 3, f"only {checked} tokens had a reference margin above {MARGIN}"
    if checked == NEW:   # the same tokens, so the same routing: the same bytes
        assert compiled["link_bytes_per_token"] == plain["link_bytes_per_token"] > 0


def test_generate_compile_refuses_jamba_with_one_error_line(capsys, tmp_path):
    folder = make_tiny(tmp_path / "jamba", family="jamba", **SIZES)
    rc, out, err = run_cli(capsys, "generate", folder, "--prompt", PROMPT, "--max-new-tokens", 2, "--device", "cpu",
                           "--compile")
    assert rc == 2 and out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "--compile" in lines[0] and "jamba" in lines[0], err


def test_bench_compile_rows_carry_compile_and_compile_s(capsys, model_dir):
    rows = _json(capsys, "bench", model_dir, "--compile", "--experts", "grouped", "--arms", "resident", "--runs", 1,
                 "--max-new-tokens", 4, "--concurrency", 1, "--device", "cpu", "--json", "-")
    assert [r["arm"] for r in rows] == ["resident"]
    (row,) = rows
    assert row["compile"] is True and row["experts"] == "grouped" and row["runs"] == 1
    assert isinstance(row["compile_s"], float) and row["compile_s"] >= 0
