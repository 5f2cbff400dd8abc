"""`--plan PLAN.json` on generate and bench (docs/cli.md: "`--plan PLAN.json` everywhere a placement is used").

A plan saved by `plan --save` loads exactly as planning the same budget does (same tokens, same offloaded and
link bytes); bench measures it as the arm `plan`, its settings read back from the loaded model; budget options,
placement arms and a plan of another model are refused beside it, exit 2 with one `error:` line.

The model is a make_tiny Qwen3-MoE (hidden 32, 2 layers, 4 experts, top-k 2, float32); 0.00009 GiB (96,637 B)
offloads its embedding (65,536 B) and 3 of the 4 experts of layer 0's gate_up_proj (12,288 B each): a tensor
split by expert, which the loaded model must hold as the plan says.
"""

from __future__ import annotations

import json

import pytest

import moe_offload as mo
from fixtures_cli import QWEN3_CONFIG, run_cli as run
from moe_offload.tiny.make import make_tiny

BUDGET = ("--offload-gb", "0.00009")
GENERATE = ("--prompt", "The river", "--max-new-tokens", "5", "--ignore-eos", "--device", "cpu", "--json")
BENCH = ("--device", "cpu", "--concurrency", "1", "--runs", "1", "--max-new-tokens", "2", "--json", "-")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("plan-everywhere") / "m", family="qwen3_moe", layers=2, experts=4,
                     top_k=2, hidden=32)


def _save(capsys, model, path, *budget):
    rc, _, err = run(capsys, "plan", model, *budget, "--save", path, "--json")
    assert rc == 0, err
    return path


def _one_error_line(rc, out, err) -> str:
    assert rc == 2 and out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.mark.parametrize("budget", [BUDGET, (*BUDGET, "--policy", "declaration"), (*BUDGET, "--dtype", "bf16")],
                         ids=["sparse-first", "declaration", "bf16"])
def test_generate_with_a_saved_plan_is_generate_with_its_budget(capsys, model_dir, tmp_path, budget):
    saved = _save(capsys, model_dir, tmp_path / "plan.json", *budget)
    rc, out, err = run(capsys, "generate", model_dir, *budget, *GENERATE)
    assert rc == 0, err
    direct = json.loads(out)
    rc, out, err = run(capsys, "generate", model_dir, "--plan", saved, *GENERATE)
    assert rc == 0, err
    planned = json.loads(out)
    assert planned["token_ids"] == direct["token_ids"] and len(planned["token_ids"]) == 5
    assert planned["offloaded_bytes"] == direct["offloaded_bytes"] > 65536   # experts too, not the embedding alone
    assert planned["offloaded_bytes"] == mo.Plan.from_json(saved.read_text()).offloaded_bytes
    assert planned["link_bytes_per_token"] == direct["link_bytes_per_token"] > 0
    assert planned["planned_link_bytes_per_token"] == direct["planned_link_bytes_per_token"]


def test_bench_measures_a_saved_plan_as_the_arm_plan(capsys, model_dir, tmp_path):
    saved = _save(capsys, model_dir, tmp_path / "plan.json", *BUDGET)
    plan = mo.Plan.from_json(saved.read_text())
    rc, out, err = run(capsys, "bench", model_dir, "--plan", saved, "--arms", "resident", *BENCH)
    assert rc == 0, err
    resident, row = json.loads(out)
    assert resident["arm"] == "resident" and resident["offloaded_bytes"] == 0
    assert resident["settings"]["policy"] == "resident"
    assert row["arm"] == "plan" and row["runs"] == 1 and row["link_bytes_per_token"] > 0
    # The settings are read back from the loaded model: they match the saved plan tensor by tensor.
    settings = row["settings"]
    assert settings["policy"] == plan.policy and settings["budget_bytes"] == plan.budget_bytes
    assert settings["offload_params"] == list(plan.offload_params)
    assert row["offloaded_bytes"] == plan.offloaded_bytes
    assert settings["host_bytes_by_role"] == {role: r["offloaded_bytes"] for role, r in plan.to_dict()["roles"].items()
                                              if r["offloaded_bytes"]}
    host = {t.name for t in plan.tensors if t.tier == "host"}
    assert settings["offloaded_tensor_count"] == len(host) and set(settings["offloaded_tensors"]) == host
    split = {t.name: t.host_experts for t in plan.tensors if 0 < t.host_experts < t.shape[0]}
    assert split and settings["split_tensors"] == split
    assert row["planned_link_bytes_per_token"] == plan.link_bytes_per_token(1)


def test_bench_of_a_saved_plan_alone_by_default(capsys, model_dir, tmp_path):
    saved = _save(capsys, model_dir, tmp_path / "plan.json", *BUDGET)
    rc, out, err = run(capsys, "bench", model_dir, "--plan", saved, *BENCH)
    assert rc == 0, err
    assert [r["arm"] for r in json.loads(out)] == ["plan"]


@pytest.mark.parametrize("extra", [BUDGET, ("--device-memory", "1"), ("--reserve-gb", "1"), ("--host-memory", "1"),
                                   ("--dtype", "fp32"), ("--policy", "declaration"),
                                   ("--offload-params", "experts"), ("--stats", "trace.jsonl")])
def test_generate_refuses_budget_options_beside_a_plan(capsys, model_dir, tmp_path, extra):
    saved = _save(capsys, model_dir, tmp_path / "plan.json", *BUDGET)
    line = _one_error_line(*run(capsys, "generate", model_dir, "--plan", saved, *extra, *GENERATE))
    assert "--plan" in line and "both decide the placement" in line


@pytest.mark.parametrize("extra, says", [
    (BUDGET, "--offload-gb"),
    (("--device-memory", "1"), "--device-memory"),
    (("--dtype", "fp32"), "--dtype"),
    (("--stats", "trace.jsonl"), "--stats"),
    (("--arms", "declaration"), "declaration"),
    (("--arms", "resident,sparse-first"), "sparse-first"),
    (("--arms", "explicit:experts"), "explicit:experts"),
    (("--arms", "frequency"), "frequency"),
    (("--arms", "accelerate,plan"), "accelerate"),
])
def test_bench_refuses_budget_options_and_placement_arms_beside_a_plan(capsys, model_dir, tmp_path, extra, says):
    saved = _save(capsys, model_dir, tmp_path / "plan.json", *BUDGET)
    line = _one_error_line(*run(capsys, "bench", model_dir, "--plan", saved, *extra, *BENCH))
    assert "--plan" in line and says in line and "both decide the placement" in line


def test_bench_refuses_the_plan_arm_without_a_plan(capsys, model_dir):
    line = _one_error_line(*run(capsys, "bench", model_dir, "--arms", "resident,plan", *BUDGET, *BENCH))
    assert "--plan PLAN.json" in line and "moe-offload plan" in line


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_a_plan_of_another_model_or_no_plan_file_is_refused(capsys, model_dir, tmp_path, command):
    other = tmp_path / "three-layers"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**QWEN3_CONFIG, "num_hidden_layers": 3}))
    saved = _save(capsys, other / "config.json", tmp_path / "other.json", *BUDGET)
    options = GENERATE if command == "generate" else BENCH
    line = _one_error_line(*run(capsys, command, model_dir, "--plan", saved, *options))
    assert f"is not a plan of {model_dir}" in line and "moe-offload plan" in line
    line = _one_error_line(*run(capsys, command, model_dir, "--plan", tmp_path / "missing.json", *options))
    assert "cannot read --plan" in line


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_help_names_the_plan_option(capsys, command):
    rc, out, _ = run(capsys, command, "--help")
    assert rc == 0 and "--plan PLAN.json" in out
