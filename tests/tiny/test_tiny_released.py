"""make-tiny's attention heads (--heads / --kv-heads / --head-dim) and its checkpoints shaped as the released ones.

What llama.cpp's converter and loader expect of released checkpoints (vendor/llama.cpp in llama-cpp-python's
source package): OLMoE's attn_k_norm of the hidden size (as many KV heads as query heads), DeepSeek-V2's
q_lora_rank (the Lite layout is recognised only at 26/27 layers), DeepSeek's scoring_func, Qwen3-VL-MoE's
fused experts stored [E, H, 2I] / [E, I, H], GLM-4.5's named special tokens, Jamba's SentencePiece-style
vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from moe_offload.prompts import PROMPTS
from moe_offload.tiny.families import AUTO_CLASSES, FAMILIES, HEAD_DIM_FIELD, KV_HEADS_ARE_HEADS
from moe_offload.tiny.make import make_tiny
from moe_offload.tiny.tokenizer import GLM_TOKENS, LLAMA_CPP_PRE_TOKENIZER

SMALL = dict(experts=4, top_k=2, layers=2)
MLA = {"deepseek_v3", "deepseek_v2"}


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def _load(path: Path, family: str):
    model = getattr(transformers, AUTO_CLASSES[family]).from_pretrained(path, local_files_only=True).eval()
    return model, transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)


def _shapes(path: Path) -> dict[str, list[int]]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_slice(k).get_shape() for k in f.keys()}


def _attention(model):
    cfg = model.config.get_text_config()
    layers = model.model.language_model.layers if hasattr(model.model, "language_model") else model.model.layers
    return cfg, next(layer.self_attn for layer in layers if hasattr(layer, "self_attn"))


def _heads_as_built(model) -> tuple[int, int, int]:
    """(query heads, key/value heads, head size) of the first attention layer as transformers built it."""
    cfg, attn = _attention(model)
    if cfg.model_type in MLA:
        q = attn.q_b_proj if getattr(attn, "q_b_proj", None) is not None else attn.q_proj
        assert q.out_features == cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        return cfg.num_attention_heads, cfg.num_key_value_heads, cfg.v_head_dim
    out = attn.o_proj.in_features if hasattr(attn, "o_proj") else attn.out_proj.in_features
    k_out = attn.k_proj.out_features
    head = out // cfg.num_attention_heads
    return out // head, k_out // head, head


# --- heads ---------------------------------------------------------------------------------------------------

def test_defaults_are_what_make_tiny_always_wrote(tmp_path):
    for family in ("qwen3_moe", "deepseek_v3", "olmoe"):
        out = make_tiny(tmp_path / family, family=family, hidden=64, **SMALL)
        record = json.loads((out / "moe_offload_tiny.json").read_text())
        kv = 4 if family in KV_HEADS_ARE_HEADS else 2
        assert (record["heads"], record["kv_heads"], record["head_dim"]) == (4, kv, 16)
        cfg = transformers.AutoConfig.from_pretrained(out)
        assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, kv)


# Every family with heads x head_dim == hidden (any family can), then hidden apart from heads x head_dim (the
# families with a head_dim field of their own): transformers builds, loads and generates each one.
_CASES = [(f, dict(hidden=128, heads=2, head_dim=64)) for f in FAMILIES] + [
    (f, dict(hidden=64, heads=2, head_dim=64)) for f in sorted(HEAD_DIM_FIELD)] + [
    (f, dict(hidden=64, heads=8, kv_heads=1)) for f in ("qwen3_moe", "mixtral", "jamba", "glm4_moe")]


@pytest.mark.parametrize("family, heads", _CASES, ids=lambda v: v if isinstance(v, str) else
                         "-".join(f"{k}{x}" for k, x in v.items()))
def test_heads_build_load_and_generate(tmp_path, family, heads):
    out = make_tiny(tmp_path / "m", family=family, **SMALL, **heads)
    model, tok = _load(out, family)
    n, kv, hd = heads["heads"], heads.get("kv_heads"), heads.get("head_dim", heads["hidden"] // heads["heads"])
    kv = n if family in KV_HEADS_ARE_HEADS else (kv or n // 2)
    assert _heads_as_built(model) == (n, kv, hd)
    assert model.config.get_text_config().hidden_size == heads["hidden"]
    record = json.loads((out / "moe_offload_tiny.json").read_text())
    assert (record["heads"], record["kv_heads"], record["head_dim"]) == (n, kv, hd)
    enc = tok(PROMPTS[2], return_tensors="pt")
    with torch.no_grad():
        gen = model.generate(**enc, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert gen.shape[-1] == enc["input_ids"].shape[-1] + 3


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - HEAD_DIM_FIELD))
def test_head_dim_apart_from_hidden_is_refused_where_the_family_derives_it(tmp_path, family):
    with pytest.raises(ValueError, match=rf"head_dim=64 is invalid for {family} .*no head_dim of its own.*Fix: "
                                         r"pass hidden=128"):
        make_tiny(tmp_path / "m", family=family, hidden=64, heads=2, head_dim=64)
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("family", sorted(KV_HEADS_ARE_HEADS))
def test_grouped_kv_heads_are_refused_where_the_family_has_none(tmp_path, family):
    with pytest.raises(ValueError, match=rf"kv_heads=2 is invalid for {family}: .*Fix: .*kv_heads=4"):
        make_tiny(tmp_path / "m", family=family, kv_heads=2)


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(heads=0), "heads=0 is invalid"),
    (dict(heads=3), "hidden=64 is invalid for heads=3"),
    (dict(head_dim=62), "head_dim=62 is invalid: .*divisible by 4"),
    (dict(heads=8, kv_heads=3), "kv_heads=3 is invalid for heads=8"),
    (dict(head_dim=2.5), "head_dim=2.5 is not an integer"),
])
def test_bad_heads_raise_before_anything_is_built(tmp_path, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern) as err:
        make_tiny(tmp_path / "m", family="qwen3_moe", **kwargs)
    assert "Fix:" in str(err.value)
    assert not (tmp_path / "m").exists()


def test_cli_heads_flags(tmp_path, capsys):
    from moe_offload.cli.main import main

    assert main(["make-tiny", str(tmp_path / "m"), "--family", "qwen3_moe", "--hidden", "64", "--heads", "2",
                 "--kv-heads", "1", "--head-dim", "64", "--experts", "4"]) == 0
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["hidden_size"]) == (
        2, 1, 64, 64)
    capsys.readouterr()
    assert main(["make-tiny", str(tmp_path / "o"), "--family", "olmoe", "--head-dim", "64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: head_dim=64 is invalid for olmoe") and err.count("\n") == 1 and "Fix:" in err
    assert not (tmp_path / "o").exists()


# --- shaped as the released checkpoints ------------------------------------------------------------------------

def test_olmoe_has_as_many_kv_heads_as_query_heads(tmp_path):
    # llama.cpp (src/models/olmoe.cpp): attn_k_norm {n_embd}, attn_k {n_embd, n_embd_gqa}.
    out = make_tiny(tmp_path / "m", family="olmoe", hidden=64, **SMALL)
    cfg = transformers.AutoConfig.from_pretrained(out)
    assert cfg.num_key_value_heads == cfg.num_attention_heads == 4
    shapes = _shapes(out)
    assert shapes["model.layers.0.self_attn.k_norm.weight"] == [64]
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == [64, 64]


def test_deepseek_v2_is_the_full_model_with_compressed_queries(tmp_path):
    # llama.cpp (src/models/deepseek2.cpp) reads q_lora_rank unless the layer count is Lite's (26 or 27).
    out = make_tiny(tmp_path / "m", family="deepseek_v2", hidden=64, **SMALL)
    cfg = transformers.AutoConfig.from_pretrained(out)
    assert cfg.q_lora_rank == 32 and cfg.topk_method == "group_limited_greedy" and cfg.n_group == 1
    shapes = _shapes(out)
    assert shapes["model.layers.0.self_attn.q_a_proj.weight"] == [32, 64]
    assert not any(k.endswith("self_attn.q_proj.weight") for k in shapes)


def test_deepseek_config_names_its_router_scoring_as_released(tmp_path):
    # llama.cpp's TextModel.set_gguf_parameters maps scoring_func to expert_gating_func; without it the
    # deepseek2 loader falls back to softmax, and a sigmoid-routed V3 then routes differently there.
    for family, scoring in (("deepseek_v3", "sigmoid"), ("deepseek_v2", "softmax")):
        out = make_tiny(tmp_path / family, family=family, hidden=32, **SMALL)
        assert json.loads((out / "config.json").read_text())["scoring_func"] == scoring


def test_qwen3_vl_moe_experts_are_stored_as_released(tmp_path):
    # Released [E, H, 2I] / [E, I, H]; llama.cpp's Qwen3VLMoeTextModel splits gate_up_proj along its last dim.
    from safetensors.torch import load_file

    out = make_tiny(tmp_path / "m", family="qwen3_vl_moe", hidden=64, **SMALL)
    key = "model.language_model.layers.0.mlp.experts."
    shapes = _shapes(out)
    assert shapes[key + "gate_up_proj"] == [4, 64, 192] and shapes[key + "down_proj"] == [4, 96, 64]
    model, _ = _load(out, "qwen3_vl_moe")
    stored = load_file(out / "model.safetensors")
    experts = model.model.language_model.layers[0].mlp.experts
    assert torch.equal(experts.gate_up_proj, stored[key + "gate_up_proj"].transpose(1, 2))
    assert torch.equal(experts.down_proj, stored[key + "down_proj"].transpose(1, 2))


def test_glm4_moe_tokenizer_has_the_tokens_llama_cpp_looks_up(tmp_path):
    # llama.cpp's _set_vocab_glm: get_added_vocab()["[gMASK]"] (bos), ["<|user|>"] (eot), ["<|endoftext|>"]
    # (unk), ["<|observation|>"] (eom).
    out = make_tiny(tmp_path / "m", family="glm4_moe", hidden=32, **SMALL)
    added = transformers.AutoTokenizer.from_pretrained(out).get_added_vocab()
    assert set(GLM_TOKENS) <= set(added) and len({added[t] for t in GLM_TOKENS}) == 4


def test_jamba_tokenizer_is_the_llama_style_vocabulary_the_converter_reads(tmp_path):
    # llama.cpp's JambaModel.set_vocab: tokenizer.model, else gguf.LlamaHfVocab (BPE with byte_fallback and a
    # Sequence decoder); there is no byte-level fallback for Jamba.
    import gguf

    out = make_tiny(tmp_path / "m", family="jamba", hidden=32, **SMALL)
    vocab = gguf.LlamaHfVocab(out)
    tokens = list(vocab.all_tokens())
    assert len(tokens) == vocab.vocab_size == 512
    assert sum(t == gguf.TokenType.BYTE for _, _, t in tokens) == 256
    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "Fallback: héllo ☃ — 42\n"
    assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text
    assert tok.convert_ids_to_tokens(tok("The quick fox")["input_ids"])[:2] == ["<s>", "The"]  # no dummy prefix


def test_byte_level_tokenizer_is_gpt2s_pre_tokenizer(tmp_path):
    # The name llama.cpp's converter is told: "gpt-2" (LLAMA_VOCAB_PRE_TYPE_GPT2, GPT-2's split regex over
    # GPT-2 byte encoding), which is what tokenizers' ByteLevel with its regex does.
    out = make_tiny(tmp_path / "m", family="qwen3_moe", hidden=32, **SMALL)
    data = json.loads((out / "tokenizer.json").read_text())
    assert data["pre_tokenizer"] == {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                     "use_regex": True}
    assert data["normalizer"] is None and data["model"]["type"] == "BPE" and not data["model"]["ignore_merges"]
    assert LLAMA_CPP_PRE_TOKENIZER == "gpt-2"
