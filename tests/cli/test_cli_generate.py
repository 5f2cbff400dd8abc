"""`moe-offload generate` and `make-tiny` through the CLI entry point (the contract in docs/cli.md)."""

import json
import shutil

import pytest
import torch
from transformers import AutoTokenizer

from fixtures_models import reference_model
from moe_offload.cli.main import main
from moe_offload.tiny.make import make_tiny


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("gen") / "m", family="qwen3_moe", layers=2, experts=4, top_k=2,
                     hidden=32)


def _run(capsys, *argv):
    code = main(list(map(str, argv)))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.exact
@pytest.mark.parametrize("backend", ["uva", "prefetch"])
def test_generate_json_matches_transformers_and_counts_link_bytes(capsys, model_dir, backend):
    # --experts eager: the experts class's own arithmetic, as the transformers reference computes it
    code, out, err = _run(capsys, "generate", model_dir, "--prompt", "The river", "--max-new-tokens", 5,
                          "--ignore-eos", "--offload-gb", 0.0001, "--backend", backend, "--experts", "eager", "--json")
    assert code == 0
    result = json.loads(out)  # one JSON document and nothing else on stdout
    for field in ("text", "token_ids", "device", "backend", "offloaded_bytes", "link_bytes_per_token",
                  "tokens_per_s"):
        assert field in result
    assert result["backend"] == backend and result["device"] == "cpu"
    assert "no accelerator" in result["mechanism"]
    assert len(result["token_ids"]) == 5
    # 0.0001 GiB = 107,375 bytes, more than the embedding (512 x 32 fp32 = 65,536 B): experts offloaded too,
    # so every decode step reads some bytes.
    assert result["offloaded_bytes"] >= 107_375 and result["link_bytes_per_token"] > 0
    ref = reference_model(model_dir, "qwen3_moe")
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok("The river", return_tensors="pt")
    with torch.no_grad():
        expected = ref.generate(**ids, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert result["token_ids"] == expected[0, ids["input_ids"].shape[1]:].tolist()
    assert result["text"] == tok.decode(result["token_ids"], skip_special_tokens=True)


def test_generate_human_output_names_the_mechanism(capsys, model_dir):
    code, out, err = _run(capsys, "generate", model_dir, "--prompt", "Stars", "--max-new-tokens", 2,
                          "--offload-gb", 0.0001)
    assert code == 0 and out.startswith("Stars")
    assert "no accelerator" in err and "link bytes per decoded token" in err


@pytest.mark.parametrize("argv, message", [
    (["--device", "cuda"], "not available"),
    (["--offload-gb", "5"], "more than the whole model"),
    (["--offload-params", "expert", "--offload-gb", "0.00001"], "matches no tensor"),
    (["--max-new-tokens", "0"], "at least 1"),
])
def test_generate_user_errors_exit_2_with_one_line(capsys, model_dir, argv, message):
    code, out, err = _run(capsys, "generate", model_dir, "--prompt", "x", *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error:") and message in err


def test_generate_without_tokenizer_is_refused_before_loading(capsys, model_dir, tmp_path):
    folder = tmp_path / "weights-only"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(model_dir / name, folder / name)
    code, out, err = _run(capsys, "generate", folder, "--prompt", "x")
    assert code == 2 and err.startswith("error:") and "no tokenizer" in err


def test_unknown_backend_is_a_usage_error(capsys, model_dir):
    with pytest.raises(SystemExit) as exc:
        main(["generate", str(model_dir), "--prompt", "x", "--backend", "magic"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1


def test_make_tiny_cli(capsys, tmp_path):
    code, out, err = _run(capsys, "make-tiny", tmp_path / "t", "--family", "mixtral", "--layers", 1, "--experts",
                          4, "--top-k", 2, "--hidden", 32, "--dtype", "bf16")
    assert code == 0 and (tmp_path / "t" / "config.json").is_file()
    assert json.loads((tmp_path / "t" / "config.json").read_text())["num_local_experts"] == 4
    code, out, err = _run(capsys, "make-tiny", tmp_path / "t", "--family", "mixtral")
    assert code == 2 and err.startswith("error:")  # non-empty folder refused, left as it was
    assert (tmp_path / "t" / "config.json").is_file()


def test_generate_stops_at_eos_unless_ignore_eos(capsys, model_dir, tmp_path):
    code, out, _ = _run(capsys, "generate", model_dir, "--prompt", "The river", "--max-new-tokens", 6,
                        "--ignore-eos", "--json")
    tokens = json.loads(out)["token_ids"]
    # A copy of the model whose EOS is the third token it generates greedily.
    copy = tmp_path / "eos"
    shutil.copytree(model_dir, copy)
    gen = json.loads((copy / "generation_config.json").read_text())
    gen["eos_token_id"] = tokens[2]
    (copy / "generation_config.json").write_text(json.dumps(gen))
    code, out, _ = _run(capsys, "generate", copy, "--prompt", "The river", "--max-new-tokens", 6, "--json")
    assert json.loads(out)["token_ids"] == tokens[:3]
    code, out, _ = _run(capsys, "generate", copy, "--prompt", "The river", "--max-new-tokens", 6, "--ignore-eos",
                        "--json")
    assert json.loads(out)["token_ids"] == tokens


def test_help_names_no_path_a_user_does_not_have(capsys):
    for argv in ([], ["plan"], ["generate"], ["bench"], ["make-tiny"]):
        with pytest.raises(SystemExit) as exc:
            main([*argv, "--help"])
        assert exc.value.code == 0
        out = capsys.readouterr().out
        assert "usage: moe-offload" in out
        assert "../" not in out and "shared/" not in out, out


def test_generate_on_an_invalid_config_says_the_config_is_not_json(capsys, model_dir, tmp_path):
    copy = tmp_path / "broken"
    shutil.copytree(model_dir, copy)
    (copy / "config.json").write_text('{"model_type": "qwen3_moe", ')   # cut off mid-file
    code, out, err = _run(capsys, "generate", copy, "--prompt", "x")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("error:") and "config.json is not valid JSON" in err and "tokenizer" not in err


def test_generate_refuses_an_empty_prompt_before_loading(capsys, model_dir, monkeypatch):
    from moe_offload.cli import run_commands as commands

    def loaded(*args, **kwargs):
        raise AssertionError("generate loaded the model for an empty prompt")

    monkeypatch.setattr(commands, "load_for_cli", loaded)
    code, out, err = _run(capsys, "generate", model_dir, "--prompt", "")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith('error: --prompt "" is empty')
