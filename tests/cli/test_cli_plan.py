"""`moe-offload plan` against the contract in docs/cli.md.

The model is a config.json alone (no weights: plan builds it on the meta device):
Qwen3-MoE, hidden 32, 2 layers, 4 experts, top-k 2, vocab 128, float32 (4 bytes per element).

    model.embed_tokens.weight                (128, 32)      16384 B   embedding (density 1/128)
    per layer (x2):
      self_attn.q_proj / o_proj.weight       (32, 32)        4096 B each
      self_attn.k_proj / v_proj.weight       (16, 32)        2048 B each   (2 kv heads x head_dim 8)
      self_attn.q_norm / k_norm.weight       (8,)              32 B each
      mlp.experts.gate_up_proj               (4, 32, 32)    16384 B   routed expert (density 1/2)
      mlp.experts.down_proj                  (4, 32, 16)     8192 B   routed expert
      mlp.gate.weight                        (4, 32)          512 B   router
      input_layernorm / post_attention_layernorm (32,)        128 B each
                                                            -------
                                                  layer     37696 B   (experts 24576 B)
    model.norm.weight                        (32,)            128 B
    lm_head.weight                           (128, 32)      16384 B
                                                           --------
                                             total         108288 B = 27072 params (105.75 KiB)
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import moe_offload as mo
from fixtures_cli import run_cli as run
from moe_offload.planning.placement import GiB, Plan

CONFIG = {
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 128, "tie_word_embeddings": False,
}
TOTAL = 108288
EMBED, EXPERTS = 16384, 2 * (16384 + 8192)   # 16384 + 49152 = 65536: what sparse-first offloads first
EXPERT_NAMES = [f"model.layers.{i}.mlp.experts.{w}" for i in (0, 1) for w in ("gate_up_proj", "down_proj")]


def gb(nbytes: int) -> str:
    """A byte count as a GiB argument, exactly (GiB is a power of two; repr round-trips)."""
    return repr(nbytes / GiB)


@pytest.fixture
def model_dir(tmp_path) -> Path:
    d = tmp_path / "tiny-qwen3-moe"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**CONFIG, "dtype": "float32"}))
    return d


def flat(text: str) -> str:
    """Terminal output with rich's line wrapping undone."""
    return " ".join(text.split())


def check_document(doc: dict, *, batch: int = 1) -> None:
    for key in ("total_params", "active_params", "total_bytes", "offloaded_bytes", "resident_bytes",
                "budget_bytes", "link_bytes_per_token", "roles", "tensors", "notes"):
        assert key in doc, key
    assert doc["total_params"] == 27072
    # no embedding (4096), experts (12288 params) at 2/4: 27072 - 4096 - 6144
    assert doc["active_params"] == 16832
    assert doc["total_bytes"] == TOTAL
    assert doc["budget_bytes"] == EMBED + EXPERTS == 65536
    assert doc["offloaded_bytes"] == 65536 and doc["resident_bytes"] == TOTAL - 65536 == 42752
    if batch == 1:   # 16384 / 128 + 49152 x 1/2
        assert doc["link_bytes_per_token"] == pytest.approx(128 + 24576)
    else:            # (16384 x 4/128 + 49152 x 15/16) / 4
        assert doc["link_bytes_per_token"] == pytest.approx((512 + 46080) / 4)
    roles = doc["roles"]
    assert roles["routed_expert"] == {"params": 12288, "bytes": 49152, "offloaded_bytes": 49152}
    assert roles["shared_expert"] == {"params": 0, "bytes": 0, "offloaded_bytes": 0}
    assert roles["router"] == {"params": 256, "bytes": 1024, "offloaded_bytes": 0}
    assert roles["embedding"] == {"params": 4096, "bytes": 16384, "offloaded_bytes": 16384}
    assert roles["lm_head"] == {"params": 4096, "bytes": 16384, "offloaded_bytes": 0}
    assert sum(r["bytes"] for r in roles.values()) == TOTAL
    tensors = doc["tensors"]
    assert len(tensors) == 1 + 2 * 11 + 2
    for t in tensors:
        assert {"name", "shape", "dtype", "role", "layer", "component", "bytes", "tier"} <= set(t)
        assert t["role"] in roles and t["tier"] in ("device", "host", "disk") and t["component"] == "language"
    by_name = {t["name"]: t for t in tensors}
    assert by_name["model.layers.1.mlp.experts.down_proj"] == {
        **by_name["model.layers.1.mlp.experts.down_proj"],
        "shape": [4, 32, 16], "dtype": "float32", "role": "routed_expert", "layer": 1, "component": "language",
        "bytes": 8192, "tier": "host"}
    assert by_name["model.embed_tokens.weight"]["layer"] is None
    assert sorted(n for n, t in by_name.items() if t["tier"] == "host") == sorted(
        ["model.embed_tokens.weight", *EXPERT_NAMES])
    assert isinstance(doc["notes"], list) and all(isinstance(n, str) for n in doc["notes"])


# ---------------------------------------------------------------------------------------
# Output


def test_json_is_one_document_with_every_contract_field(model_dir, capsys):
    rc, out, err = run(capsys, "plan", model_dir, "--offload-gb", gb(65536), "--json")
    assert rc == 0
    doc = json.loads(out)   # the whole of stdout is one JSON document
    check_document(doc)
    assert doc["notes"] == []   # exactly met: no overshoot, no dense tensor, no tower


def test_json_at_batch_4(model_dir, capsys):
    rc, out, _ = run(capsys, "plan", model_dir / "config.json", "--offload-gb", gb(65536), "--batch", 4, "--json")
    assert rc == 0
    check_document(json.loads(out), batch=4)


def test_human_output_shows_the_table_and_notes(model_dir, capsys):
    rc, out, err = run(capsys, "plan", model_dir, "--offload-gb", gb(65436))   # 100 B less than 65536
    assert rc == 0 and err == ""
    text = flat(out)
    for role in ("routed_expert", "router", "embedding", "lm_head", "attention", "norm", "total"):
        assert role in text
    assert "27,072" in text and "105.75 KiB" in text   # total params and bytes
    assert "active params per token: 16,832 of 27,072" in text
    assert ("note: offloaded 100 bytes more than the budget: tensors move whole, and the last one "
            "(model.layers.1.mlp.experts.down_proj, 8192 bytes) crossed the target") in text


def test_human_output_when_the_model_fits(model_dir, capsys):
    rc, out, _ = run(capsys, "plan", model_dir, "--device-memory", 3)
    assert rc == 0
    assert ("note: the model fits: 105.75 KiB of weights + 2 GiB reserve <= 3 GiB of device memory; "
            "nothing offloaded") in flat(out)


def test_human_output_prints_notes_verbatim(model_dir):
    # Notes and model types are text: brackets in them are not rich markup, to be swallowed or to crash.
    from rich.console import Console

    from moe_offload.cli.report import print_plan

    p = dataclasses.replace(mo.plan(model_dir), model_type="[custom]",
                            notes=("experts are [e, 2i, h] fused tensors", "a stray [/] tag"))
    console = Console(file=io.StringIO(), width=200)
    print_plan(p, console)
    text = console.file.getvalue()
    assert "[custom]: sparse-first plan" in text
    assert "note: experts are [e, 2i, h] fused tensors" in text and "note: a stray [/] tag" in text


def test_save_writes_a_plan_that_round_trips(model_dir, tmp_path, capsys):
    saved = tmp_path / "plan.json"
    rc, out, _ = run(capsys, "plan", model_dir, "--offload-gb", gb(65536), "--json", "--save", saved)
    assert rc == 0
    assert json.loads(saved.read_text()) == json.loads(out)
    loaded = Plan.from_json(saved.read_text())
    assert loaded == mo.plan(model_dir, offload_gb=65536 / GiB)
    assert loaded.tiers["model.layers.0.mlp.experts.gate_up_proj"] == "host"
    assert loaded.tiers["lm_head.weight"] == "device"

    human = tmp_path / "human.json"
    rc, out, _ = run(capsys, "plan", model_dir, "--offload-gb", gb(65536), "--save", human)
    assert rc == 0 and f"plan saved to {human}" in flat(out)
    assert Plan.from_json(human.read_text()) == loaded


# ---------------------------------------------------------------------------------------
# User errors: status 2, one `error:` line, nothing on stdout, no file left behind


def _broken_config(tmp_path: Path, text: str) -> Path:
    d = tmp_path / "broken"
    d.mkdir()
    (d / "config.json").write_text(text)
    return d


@pytest.mark.parametrize("case, extra, says", [
    ("missing path", [], "does not exist"),
    ("malformed config", [], "is not valid JSON"),
    ("config without model_type", [], "has no 'model_type'"),
    ("impossible budget", ["--offload-gb", "1"], "more than the whole model"),
    ("device too small", ["--device-memory", "1"], "less than the 2.0 GiB reserve"),
    ("reserve smaller than the process", ["--device", "cpu", "--device-memory", "0.01", "--reserve-gb", "0.005"],
     "--device-memory 0.01 GiB cannot bound this process"),
    ("unknown policy", ["--policy", "fastest", "--offload-gb", "0"], "invalid choice: 'fastest'"),
    ("selectors match nothing", ["--offload-params", "expert", "--offload-gb", "0"], "matches no tensor"),
    ("negative budget", ["--offload-gb", "-1"], "is not a size"),
    ("reserve without device memory", ["--reserve-gb", "1"], "only applies with --device-memory"),
    ("two budgets", ["--offload-gb", "0", "--device-memory", "3"], "give one of them"),
    ("zero batch", ["--batch", "0"], "at least 1"),
    ("budget not a number", ["--offload-gb", "lots"], "invalid float value"),
])
@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_user_errors(case, extra, says, json_flag, model_dir, tmp_path, capsys):
    if case == "missing path":
        model = tmp_path / "absent"
    elif case == "malformed config":
        model = _broken_config(tmp_path, '{"model_type": "qwen3_moe",')
    elif case == "config without model_type":
        model = _broken_config(tmp_path, '{"hidden_size": 32}')
    else:
        model = model_dir
    before = sorted(p.name for p in tmp_path.iterdir())
    saved = tmp_path / "plan.json"
    rc, out, err = run(capsys, "plan", model, *extra, *json_flag, "--save", saved)
    assert rc == 2
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], err
    assert not saved.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == before   # no temporary file either


def test_unwritable_save_path_is_a_user_error(model_dir, tmp_path, capsys):
    saved = tmp_path / "no-such-dir" / "plan.json"
    rc, out, err = run(capsys, "plan", model_dir, "--offload-gb", gb(65536), "--json", "--save", saved)
    assert rc == 2 and out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot write {saved}")
    assert not (tmp_path / "no-such-dir").exists()


# ---------------------------------------------------------------------------------------
# The installed command


def test_installed_console_script(tmp_path):
    script = Path(sys.executable).parent / "moe-offload"
    assert script.is_file(), f"{script} is missing: install the package (pip install -e .)"
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CONFIG))   # no dtype: float32, transformers' default
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([str(script), "plan", str(d), "--offload-gb", gb(65536), "--json"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    check_document(json.loads(proc.stdout))


def test_tensors_flag_lists_every_tensor_with_its_tier(capsys, model_dir, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    # Budget = the embedding + all experts (65,536 B): exactly those go to the host.
    rc, out, err = run(capsys, "plan", model_dir, "--offload-gb", (EMBED + EXPERTS) / 2**30, "--tensors")
    assert rc == 0
    rows = {line.split("│")[1].strip(): line.split("│")[-2].strip() for line in out.splitlines()
            if line.startswith("│ model.") or line.startswith("│ lm_head.weight")}
    assert len(rows) == len(json.loads(run(capsys, "plan", model_dir, "--json")[1])["tensors"])
    assert {n for n, tier in rows.items() if tier == "host"} == {"model.embed_tokens.weight", *EXPERT_NAMES}
