"""Tests for moe_offload.tiny.make_tiny: tiny random MoE checkpoints that transformers loads."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from moe_offload.prompts import CORPUS, PROMPTS
from moe_offload.tiny import AUTO_CLASSES, FAMILIES, make_tiny

REQUIRED_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "gpt_oss", "qwen3_vl_moe")

# Non-default sizes, so a test cannot pass by reading transformers' defaults back.
EXPERTS = 6


def _top_k(family: str) -> int:
    return 2 if family == "phimoe" else 3  # PhiMoE's router always picks exactly two


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    # Everything must load from the folder alone; nothing may come from a hub.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def _load(path: Path, family: str):
    auto = getattr(transformers, AUTO_CLASSES[family])
    model = auto.from_pretrained(path, local_files_only=True)
    tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model.eval(), tok


def _weights(path: Path) -> dict[str, tuple[list[int], str]]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: (f.get_slice(k).get_shape(), f.get_slice(k).get_dtype()) for k in f.keys()}


def _expert_count_field(cfg) -> int:
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(cfg, name, None)
        if isinstance(value, int):
            return value
    raise AssertionError(f"no routed-expert count field in {type(cfg).__name__}")


def _experts_on_disk(weights: dict[str, tuple[list[int], str]]) -> set[int]:
    """Routed experts per MoE layer as stored: per-expert keys or fused [E, ...] tensors."""
    per_expert: dict[str, set[int]] = {}
    fused: set[int] = set()
    for key, (shape, _) in weights.items():
        m = re.search(r"^(.*\.layers\.\d+)\..*\.experts\.(\d+)\.", key)
        if m:
            per_expert.setdefault(m.group(1), set()).add(int(m.group(2)))
        elif re.search(r"\.experts\.(gate_up_proj|down_proj)$|\.(input|output)_linear\.weight$", key):
            fused.add(shape[0])
    counts = {len(ix) for ix in per_expert.values()} | fused
    assert counts, "no routed-expert tensors found on disk"
    return counts


def test_required_families_present():
    assert set(REQUIRED_FAMILIES) <= set(FAMILIES)
    assert set(AUTO_CLASSES) == set(FAMILIES)


def test_prompts_and_corpus():
    assert len(PROMPTS) >= 16 and len(set(PROMPTS)) == len(PROMPTS)
    assert all(isinstance(p, str) and 20 < len(p) < 400 for p in PROMPTS)
    assert len(CORPUS) > 3000


@pytest.mark.parametrize("family", FAMILIES)
def test_family_loads_and_generates(tmp_path, family):
    top_k = _top_k(family)
    out = make_tiny(tmp_path / "m", family=family, experts=EXPERTS, top_k=top_k, seed=1)
    assert out == (tmp_path / "m").absolute()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"], "temporary folder left behind"
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "moe_offload_tiny.json"):
        assert (out / name).is_file(), name

    record = json.loads((out / "moe_offload_tiny.json").read_text())
    assert {k: record[k] for k in ("family", "layers", "experts", "top_k", "hidden", "seed", "dtype")} == {
        "family": family, "layers": 2, "experts": EXPERTS, "top_k": top_k, "hidden": 64, "seed": 1,
        "dtype": "float32",
    }

    model, tok = _load(out, family)
    cfg = model.config.get_text_config()
    assert _expert_count_field(cfg) == EXPERTS
    assert cfg.num_experts_per_tok == top_k
    assert cfg.num_hidden_layers == 2 and cfg.hidden_size == 64
    assert not model.config.tie_word_embeddings
    assert _experts_on_disk(_weights(out)) == {EXPERTS}

    # Tokenizer and model agree on the vocabulary and the special tokens.
    assert len(tok) == cfg.vocab_size == model.get_input_embeddings().weight.shape[0]
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == ("<s>", "</s>", "<pad>", "<unk>")
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (
        tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    text = PROMPTS[0]
    assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text

    enc = tok(PROMPTS[1], return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc).logits
        gen = model.generate(**enc, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert logits.float().std() > 0.1, "random init too small: outputs are all but constant"
    assert gen.shape[-1] == enc["input_ids"].shape[-1] + 5


@pytest.mark.parametrize("family", FAMILIES)
def test_deterministic(tmp_path, family):
    a = make_tiny(tmp_path / "a", family=family, seed=7)
    b = make_tiny(tmp_path / "b", family=family, seed=7)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()


def test_seed_changes_weights_and_leaves_caller_rng_alone(tmp_path):
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    a = make_tiny(tmp_path / "a", family="mixtral", seed=0)
    assert torch.equal(torch.get_rng_state(), state)
    b = make_tiny(tmp_path / "b", family="mixtral", seed=1)
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision(tmp_path, dtype):
    out = make_tiny(tmp_path / "m", family="qwen3_moe", dtype=dtype)
    stored = {"bfloat16": "BF16", "float16": "F16"}[dtype]
    assert {d for _, d in _weights(out).values()} == {stored}
    assert json.loads((out / "config.json").read_text())["dtype"] == dtype
    model, _ = _load(out, "qwen3_moe")
    assert model.dtype == getattr(torch, dtype)


def test_other_sizes(tmp_path):
    out = make_tiny(tmp_path / "m", family="deepseek_v3", layers=3, experts=4, top_k=1, hidden=32,
                    vocab_size=300)
    model, tok = _load(out, "deepseek_v3")
    assert len(tok) == model.config.vocab_size == 300
    assert model.config.first_k_dense_replace == 1 and model.config.n_group == 1
    assert len(model.model.layers) == 3


def test_empty_existing_dir_is_used(tmp_path):
    (tmp_path / "m").mkdir()
    out = make_tiny(tmp_path / "m", family="olmoe")
    assert (out / "model.safetensors").is_file()


def test_unknown_family_lists_supported(tmp_path):
    with pytest.raises(ValueError) as err:
        make_tiny(tmp_path / "m", family="llama")
    for family in FAMILIES:
        assert family in str(err.value)
    assert not (tmp_path / "m").exists()


def test_non_empty_out_dir_refused_and_untouched(tmp_path):
    target = tmp_path / "m"
    target.mkdir()
    (target / "keep.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="not empty"):
        make_tiny(target, family="qwen3_moe")
    assert [p.name for p in target.iterdir()] == ["keep.txt"]
    assert (target / "keep.txt").read_text() == "precious"
    assert [p.name for p in tmp_path.iterdir()] == ["m"], "temporary folder left behind"


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(experts=4, top_k=5), "top_k=5"),
        (dict(layers=0), "layers=0"),
        (dict(experts=0, top_k=0), "experts=0"),
        (dict(hidden=50), "hidden=50"),
        (dict(dtype="int8"), "dtype"),
        (dict(vocab_size=100), "vocab_size"),
    ],
)
def test_bad_numbers_raise(tmp_path, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern) as err:
        make_tiny(tmp_path / "m", family="qwen3_moe", **kwargs)
    assert "Fix:" in str(err.value)
    assert not (tmp_path / "m").exists()


def test_family_specific_limits(tmp_path):
    with pytest.raises(ValueError, match="phimoe"):
        make_tiny(tmp_path / "m", family="phimoe", top_k=3)
    with pytest.raises(ValueError, match="deepseek_v3"):
        make_tiny(tmp_path / "m", family="deepseek_v3", experts=1, top_k=1)


def _unwritable_dir(tmp_path: Path) -> Path:
    """A directory nothing can be created in: a read-only folder, or /sys for root (whom mode bits do not stop)."""
    import os

    if os.geteuid() == 0:
        return Path("/sys")
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o500)
    return folder


@pytest.fixture
def never_built(monkeypatch):
    """make_tiny must refuse its target before building anything (the tokenizer is trained first)."""
    from moe_offload import tiny

    def built(*args, **kwargs):
        raise AssertionError("make_tiny started building before refusing its target")

    monkeypatch.setattr(tiny, "_build_tokenizer", built)


@pytest.mark.parametrize("where", ["unwritable", "unwritable-nested", "through-a-file"])
def test_target_that_cannot_be_written_is_refused_first(tmp_path, never_built, where):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    target = {"unwritable": _unwritable_dir(tmp_path) / "m", "unwritable-nested": _unwritable_dir(tmp_path) / "a" / "m",
              "through-a-file": blocker / "sub" / "m"}[where]
    expected = NotADirectoryError if where == "through-a-file" else PermissionError
    with pytest.raises(expected, match="cannot write a tiny model to .*Fix:") as err:
        make_tiny(target, family="qwen3_moe")
    assert err.value.errno is None                  # our message, not a raw OSError
    assert ("is a file" if where == "through-a-file" else "nothing can be created") in str(err.value)
    assert blocker.read_text() == "not a folder"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "read-only") == ["a-file"]


@pytest.mark.parametrize("where", ["unwritable", "through-a-file", "a-file"])
def test_make_tiny_cli_unwritable_path_is_one_error_line(tmp_path, capsys, never_built, where):
    from moe_offload.cli import main

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    target = {"unwritable": _unwritable_dir(tmp_path) / "x", "through-a-file": blocker / "x", "a-file": blocker}[where]
    assert main(["make-tiny", str(target), "--family", "qwen3_moe"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: cannot write a tiny model to") and captured.err.count("\n") == 1
    assert "Errno" not in captured.err and "Fix:" in captured.err
