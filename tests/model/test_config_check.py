"""Malformed configs are one `error:` line naming the field, exit 2, fast, before anything is built.

Each case takes a valid config of a family (the tiny ones of conftest for every make_tiny family,
and the makers' published configs), breaks one field the way fuzzing `plan` did (issue 7), and
runs `moe-offload plan` in-process. `no_build` makes building a model an error, so a case that
passes proves the config was refused before the meta model existed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.nn as nn

import moe_offload as mo
from moe_offload.cli import main as cli
from moe_offload.model import config_check, inventory, published
from moe_offload.errors import ConfigError
from moe_offload.tiny.families import FAMILIES

from conftest import tiny_config_dict

# What fuzzing found (issue 7), and the like of them. EXPERTS / TOPK stand for the family's own field names,
# ABOVE for one more than the family's expert count (99 of 8 in the issue).
EXPERTS, TOPK, ABOVE = "<experts>", "<top-k>", "<experts + 1>"
MALFORMED = [
    ("vocab_size", 0), ("vocab_size", -1),
    ("num_key_value_heads", 0), ("num_key_value_heads", -1),
    ("head_dim", 0), ("head_dim", -1),
    ("hidden_size", -1), ("hidden_size", 0),
    ("moe_intermediate_size", -1), ("intermediate_size", -1),
    ("num_attention_heads", 0), ("num_attention_heads", -1),
    (TOPK, -1), (TOPK, 0), (TOPK, ABOVE),
    (EXPERTS, 0), (EXPERTS, -1),
    ("num_hidden_layers", 10 ** 12), ("num_hidden_layers", 0), ("num_hidden_layers", -1),
]


def _section(config: dict) -> dict:
    """The part of a config.json that sizes the language model (qwen3_vl_moe nests it in text_config)."""
    return config.get("text_config", config)


def _field(section: dict, field: str) -> str | None:
    """The family's name for a field, or None where the family has no such field."""
    if field == EXPERTS:
        return next((f for f in config_check.EXPERT_FIELDS if f in section), None)
    if field == TOPK:
        return next((f for f in config_check.TOPK_FIELDS if f in section), None)
    return field if field in section else None


def _base(source: str) -> dict:
    return json.loads(json.dumps(published.CONFIGS[source])) if source in published.CONFIGS \
        else tiny_config_dict(source)


def _cases():
    cases = []
    for source in (*FAMILIES, *published.CONFIGS):
        section = _section(_base(source))
        for field, value in MALFORMED:
            name = _field(section, field)
            if name is not None:
                shown = "experts+1" if value == ABOVE else value
                cases.append(pytest.param(source, name, value, id=f"{source}-{name}={shown}"))
    return cases


CASES = _cases()


@pytest.fixture
def no_build(monkeypatch):
    """Building a model is an error: a refused config must be refused before the meta model exists."""
    def refuse(*args, **kwargs):
        raise AssertionError("build_meta_model was called for a config that should have been refused")
    monkeypatch.setattr(inventory, "build_meta_model", refuse)


def _write(tmp_path: Path, config: dict) -> Path:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _plan_error(folder: Path, capsys) -> str:
    """Runs `moe-offload plan FOLDER`; returns its one stderr line after asserting exit 2 and no stdout."""
    start = time.perf_counter()
    rc = cli.main(["plan", str(folder), "--json"])
    elapsed = time.perf_counter() - start
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2 and out == "", (rc, out, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert elapsed < 5, f"refusing took {elapsed:.1f} s"
    return lines[0]


def test_every_family_and_published_config_has_malformed_cases():
    """The parametrization below covers every family: no family silently has no case."""
    sources = {c.values[0] for c in CASES}
    assert sources == {*FAMILIES, *published.CONFIGS}
    assert len(CASES) >= 10 * len(sources)


@pytest.mark.parametrize("source, field, value", CASES)
def test_malformed_field_is_one_error_line_naming_it(source, field, value, tmp_path, capsys, no_build):
    config = _base(source)
    section = _section(config)
    if value == ABOVE:
        value = section[_field(section, EXPERTS)] + 1
    section[field] = value
    line = _plan_error(_write(tmp_path, config), capsys)
    prefix = "text_config." if "text_config" in config else ""
    assert f"{prefix}{field}={value}" in line, line
    assert str(tmp_path / "model") in line


@pytest.mark.parametrize("field", ["num_experts", "num_local_experts"])
@pytest.mark.parametrize("value", [0, -1])
def test_both_names_of_qwen3_expert_count_are_checked(field, value, tmp_path, capsys, no_build):
    # Qwen3's published config.json says num_experts; transformers 5 writes num_local_experts (its attribute_map).
    config = tiny_config_dict("qwen3_moe")
    config[field] = value
    assert f"{field}={value}" in _plan_error(_write(tmp_path, config), capsys)


@pytest.mark.parametrize("value, words", [("64", "is not an integer"), (64.0, "is not an integer"),
                                          (True, "is not an integer")])
def test_non_integer_sizes(value, words, tmp_path, capsys, no_build):
    config = tiny_config_dict("qwen3_moe", hidden_size=32)
    config["hidden_size"] = value
    line = _plan_error(_write(tmp_path, config), capsys)
    assert "hidden_size=" in line and words in line


def test_a_billion_layers_is_refused_instantly_by_the_command(tmp_path):
    """The hang of issue 7: `num_hidden_layers` 10^12 built modules until killed. Now: refused in seconds."""
    config = tiny_config_dict("qwen3_moe")
    config["num_hidden_layers"] = 10 ** 12
    folder = _write(tmp_path, config)
    exe = Path(sys.executable).with_name("moe-offload")
    start = time.perf_counter()
    proc = subprocess.run([str(exe), "plan", str(folder)], capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "num_hidden_layers=1000000000000 is out of range" in lines[0] and "at most 1024" in lines[0]
    assert elapsed < 60, f"{elapsed:.1f} s"   # interpreter start-up included; the check itself takes microseconds


def test_top_k_above_the_experts_names_both_fields(tmp_path, capsys, no_build):
    config = tiny_config_dict("mixtral")   # 4 experts
    config["num_experts_per_tok"] = 99
    line = _plan_error(_write(tmp_path, config), capsys)
    assert "num_experts_per_tok=99 is more than num_local_experts=4" in line


def test_query_heads_in_whole_kv_groups(tmp_path, capsys, no_build):
    config = tiny_config_dict("qwen3_moe")  # 4 query heads
    config["num_key_value_heads"] = 3
    line = _plan_error(_write(tmp_path, config), capsys)
    assert "num_attention_heads=4 is not a multiple of num_key_value_heads=3" in line


def test_parameter_count_is_bounded_before_building(tmp_path, capsys, no_build):
    # Each field within its own range, together 2 * 2^24 * 2^20 = 3.5e13 embedding parameters: more than 1e13.
    config = tiny_config_dict("qwen3_moe")
    config.update(vocab_size=1 << 24, hidden_size=1 << 20)
    line = _plan_error(_write(tmp_path, config), capsys)
    assert "parameters" in line and "vocab_size=16777216" in line and "hidden_size=1048576" in line


@pytest.mark.parametrize("family, overrides, words", [
    ("deepseek_v3", dict(n_group=3), "n_routed_experts=4 is not a multiple of n_group=3"),
    ("deepseek_v3", dict(n_group=4, topk_group=1), "leaves 1 expert per group"),
    ("deepseek_v3", dict(n_group=2, topk_group=3), "topk_group=3 is more than n_group=2"),
    ("glm4_moe", dict(n_group=2, topk_group=1, num_experts_per_tok=3), "num_experts_per_tok=3 is more than the 2"),
    ("phimoe", dict(num_experts_per_tok=1), "always picks exactly 2 experts"),
    ("jamba", dict(expert_layer_offset=2), "expert_layer_offset=2 is not below expert_layer_period=2"),
    ("qwen3_next", dict(linear_num_value_heads=3), "linear_num_value_heads=3 is not a multiple"),
])
def test_family_rules(family, overrides, words, tmp_path, capsys, no_build):
    config = tiny_config_dict(family)
    config.update(overrides)
    assert words in _plan_error(_write(tmp_path, config), capsys)


def test_nested_vision_config_is_checked(tmp_path, capsys, no_build):
    config = tiny_config_dict("qwen3_vl_moe")
    config["vision_config"]["depth"] = 10 ** 12
    assert "vision_config.depth=1000000000000 is out of range" in _plan_error(_write(tmp_path, config), capsys)


def test_top_k_sampling_option_of_a_dense_config_is_not_a_router(tmp_path):
    # Old config.json files carry generation defaults; top_k=0 there means "no top-k sampling".
    config = tiny_config_dict("llama")
    config["top_k"] = 0
    p = mo.plan(_write(tmp_path, config))
    assert p.total_params > 0


@pytest.mark.parametrize("source", [*FAMILIES, *published.CONFIGS])
def test_valid_configs_pass_both_passes(source, tmp_path):
    config = _base(source)
    folder = _write(tmp_path, config)
    config_check.check_raw(config, folder)
    inventory.read_config(folder)   # check_raw and check_config inside, as plan and load run them


def test_tiny_valid_config_still_plans(tmp_path):
    p = mo.plan(_write(tmp_path, tiny_config_dict("qwen3_moe")))
    assert p.total_params == 22976   # conftest's tiny qwen3_moe, as test_inventory counts it


def test_model_constructor_errors_become_config_errors_naming_the_folder(tmp_path, capsys, monkeypatch):
    """What the checks let through and the model class still refuses is a ConfigError, not a traceback."""
    from transformers import Qwen3MoeModel

    def broken(self, config):
        raise ZeroDivisionError("integer division or modulo by zero")
    monkeypatch.setattr(Qwen3MoeModel, "__init__", broken)
    folder = _write(tmp_path, tiny_config_dict("qwen3_moe"))
    line = _plan_error(folder, capsys)
    assert str(folder) in line and "ZeroDivisionError: integer division or modulo by zero" in line
    with pytest.raises(ConfigError, match="transformers cannot build a qwen3_moe model"):
        mo.plan(folder)


def test_built_parameter_count_is_bounded_whatever_field_grew():
    # A meta tensor holds no memory: 10^7 x 10^7 = 1e14 parameters cost nothing to build, and are refused.
    with_meta = nn.Linear(10 ** 7, 10 ** 7, bias=False, device="meta")
    with pytest.raises(ConfigError, match=r"builds 1e\+14 parameters.*the largest tensor, weight \[10000000, "
                                          r"10000000\]"):
        config_check.check_built(with_meta, "somewhere")
    config_check.check_built(nn.Linear(4, 4, device="meta"), "somewhere")   # 20 parameters: fine
