"""The commands on models whose config and generation config are shaped as the released ones (issue 28 item 3):
no pad_token_id anywhere, an EOS list, EOS ids outside the tokenizer's (and the embedding's) range; and make-tiny
--like at the command line (its options, its refusals: exit 2, one `error:` line, nothing written).

The model is `make-tiny --like` of a Qwen3-30B-A3B folder (config.json as released, and a generation_config.json
with the released EOS list [151645, 151643] and no pad token) at tiny widths: hidden 64, 1 layer, 4 experts of
32, top-2, 512 tokens. Before the fix, `generate --ignore-eos` and `bench --compile` ended in IndexError in
transformers' `_prepare_special_tokens` on such a model (an emptied EOS list and no pad token).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fixtures_cli import run_cli

RELEASED = Path(__file__).resolve().parents[1] / "released_configs"
TINY_WIDTHS = ["--layers", 1, "--hidden", 64, "--experts", 4, "--top-k", 2, "--expert-ffn", 32, "--dense-ffn", 64,
               "--heads", 4, "--kv-heads", 2, "--head-dim", 16, "--vocab", 512]


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def no_pad(tmp_path_factory) -> Path:
    from moe_offload.cli.main import main

    root = tmp_path_factory.mktemp("released")
    source = root / "Qwen3-30B-A3B"
    source.mkdir()
    (source / "config.json").write_text((RELEASED / "qwen3-30b-a3b.json").read_text())
    (source / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "transformers_version": "4.51.0"}))
    assert main(["make-tiny", str(root / "m"), "--like", str(source), *map(str, TINY_WIDTHS)]) == 0
    return root / "m"


def test_the_model_is_shaped_as_released(no_pad):
    config = json.loads((no_pad / "config.json").read_text())
    gen = json.loads((no_pad / "generation_config.json").read_text())
    assert "pad_token_id" not in config and "pad_token_id" not in gen
    assert gen["eos_token_id"] == [151645, 151643] and config["vocab_size"] == 512   # EOS ids beyond the vocab


def test_generate_ignore_eos_and_not(capsys, no_pad):
    for extra in (["--ignore-eos"], []):
        rc, out, err = run_cli(capsys, "generate", no_pad, "--prompt", "The river", "--max-new-tokens", 4,
                               "--json", *extra)
        assert rc == 0, err
        assert "Traceback" not in err
        tokens = json.loads(out)["token_ids"]
        assert len(tokens) == 4 and max(tokens) < 512   # no EOS the model can produce: all 4 either way


def test_bench_compile_completes(capsys, no_pad, tmp_path):
    rc, out, err = run_cli(capsys, "bench", no_pad, "--compile", "--arms", "resident", "--runs", 1,
                           "--max-new-tokens", 2, "--json", tmp_path / "bench.json")
    assert rc == 0, err
    rows = json.loads((tmp_path / "bench.json").read_text())
    rows = rows["rows"] if isinstance(rows, dict) else rows
    assert rows and rows[0]["arm"] == "resident"


def test_profile_completes(capsys, no_pad, tmp_path):
    for extra in (["--ignore-eos"], []):
        trace = tmp_path / f"trace{len(extra)}.jsonl"
        rc, out, err = run_cli(capsys, "profile", no_pad, "--out", trace, "--max-new-tokens", 2, *extra)
        assert rc == 0, err
        assert trace.is_file() and trace.read_text().count("\n") > 1


def test_make_tiny_like_bundled_name(capsys, tmp_path):
    rc, out, err = run_cli(capsys, "make-tiny", tmp_path / "g", "--like", "gpt-oss-20b", "--layers", 1,
                           "--hidden", 64, "--experts", 4, "--top-k", 2, "--expert-ffn", 32, "--heads", 4,
                           "--kv-heads", 2, "--head-dim", 16, "--vocab", 512)
    assert rc == 0, err
    assert "like gpt-oss-20b (1 of its 24 layers" in out and "mxfp4" in out
    config = json.loads((tmp_path / "g" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4" and config["intermediate_size"] == 32


def test_make_tiny_help_names_the_new_options(capsys):
    from moe_offload.cli.main import main

    with pytest.raises(SystemExit):
        main(["make-tiny", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for option in ("--like", "--expert-ffn", "--dense-ffn", "--vocab", "qwen3-30b-a3b", "gpt-oss-20b"):
        assert option in out, option


@pytest.mark.parametrize("case", ["unknown-model-type", "malformed", "missing", "no-family", "family-mismatch",
                                  "dense-ffn-on-mixtral"])
def test_make_tiny_like_refusals(capsys, tmp_path, case):
    (tmp_path / "llama.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (tmp_path / "bad.json").write_text('{"model_type": "qwen3_moe", ')
    argv, says = {
        "unknown-model-type": (["--like", tmp_path / "llama.json"], "qwen3_moe, qwen2_moe, mixtral"),
        "malformed": (["--like", tmp_path / "bad.json"], "not valid JSON"),
        "missing": (["--like", tmp_path / "nowhere.json"], "no such file"),
        "no-family": ([], "--family F"),
        "family-mismatch": (["--like", "mixtral-8x7b", "--family", "gpt_oss"], "disagrees"),
        "dense-ffn-on-mixtral": (["--like", "mixtral-8x7b", "--layers", 1, "--dense-ffn", 64], "no dense MLP"),
    }[case]
    before = sorted(p.name for p in tmp_path.iterdir())
    rc, out, err = run_cli(capsys, "make-tiny", tmp_path / "m", *argv)
    assert rc == 2 and out == ""
    assert err.startswith("error:") and err.count("\n") == 1 and says in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before      # nothing written, no temporary folder left
