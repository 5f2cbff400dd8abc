"""`--plan PLAN.json` on replay and export: the plan must be a plan of MODEL (same tensors, both ways)."""
from __future__ import annotations

import json

import pytest
from conftest import tiny_config_dict

from moe_offload.formats.traces import TraceHeader, TraceRow, write_trace
from fixtures_cli import run_cli as run


def _config(folder, family: str, **overrides):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(tiny_config_dict(family, **overrides)))
    return folder / "config.json"




@pytest.fixture
def models(tmp_path, capsys):
    two = _config(tmp_path / "two", "qwen3_moe", num_hidden_layers=2)
    three = _config(tmp_path / "three", "qwen3_moe", num_hidden_layers=3)
    mixtral = _config(tmp_path / "mixtral", "mixtral", num_hidden_layers=2)
    for name, cfg in (("two", two), ("three", three), ("mixtral", mixtral)):
        rc, _, err = run(capsys, "plan", cfg, "--offload-gb", "0.00001", "--save", tmp_path / f"{name}.json")
        assert rc == 0, err
    rows = [TraceRow(0, i, "decode", ((0, 1), (2, 3))) for i in range(3)]
    write_trace(tmp_path / "trace.jsonl", TraceHeader("qwen3_moe", 4, 2, (0, 1), "test"), rows)
    return tmp_path, {"two": two, "three": three, "mixtral": mixtral}


def _one_error_line(rc, out, err) -> str:
    assert rc == 2 and out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.mark.parametrize("command", ["replay", "export"])
@pytest.mark.parametrize("model, plan", [("three", "two"),      # the plan lacks layer 2 of the model
                                         ("two", "three"),      # the plan has a layer the model lacks
                                         ("mixtral", "two")])   # another family
def test_a_plan_of_another_model_is_a_user_error(models, capsys, command, model, plan):
    root, configs = models
    extra = ["--trace", root / "trace.jsonl"] if command == "replay" else ["--engine", "vllm"]
    line = _one_error_line(*run(capsys, command, configs[model], "--plan", root / f"{plan}.json", *extra, "--json"))
    assert f"is not a plan of {configs[model]}" in line and "moe-offload plan" in line


@pytest.mark.parametrize("command", ["replay", "export"])
def test_the_plan_of_the_model_itself_is_accepted(models, capsys, command):
    root, configs = models
    extra = ["--trace", root / "trace.jsonl"] if command == "replay" else ["--engine", "vllm"]
    rc, out, err = run(capsys, command, configs["two"], "--plan", root / "two.json", *extra, "--json")
    assert rc == 0, err
    doc = json.loads(out)
    saved = json.loads((root / "two.json").read_text())
    # export's own offloaded_bytes is what the engine applies; plan_offloaded_bytes is the plan read back
    key = "offloaded_bytes" if command == "replay" else "plan_offloaded_bytes"
    assert doc[key] == saved["offloaded_bytes"] > 0


def test_stats_without_decode_tokens_points_at_eos_not_at_a_token_count(models, capsys):
    # profile --max-new-tokens 1 already writes one decode row per prompt, so "at least 2" was wrong advice: a
    # trace without decode rows is one whose generations stopped at EOS at once.
    root, configs = models
    prefill_only = root / "prefill.jsonl"
    write_trace(prefill_only, TraceHeader("qwen3_moe", 4, 2, (0, 1), "test"),
                [TraceRow(0, 0, "prefill", ((0, 1), (2, 3)))])
    line = _one_error_line(*run(capsys, "plan", configs["two"], "--offload-gb", "0.00001", "--policy", "frequency",
                                "--stats", prefill_only))
    assert "no decode tokens" in line and "--ignore-eos" in line and "at least 2" not in line
