"""Inventory: parameter counts against published numbers, storage bytes under quantization,
checkpoint headers against config, checkpoint layouts, and loud errors on bad input.

Full-size configs are written by hand from the makers' published config.json and built on
the meta device (no memory for weights). Tiny checkpoints are written by save_pretrained.
"""

from __future__ import annotations

import json
import math
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

import moe_offload as mo
from moe_offload.errors import CheckpointError, ConfigError
from moe_offload.model.config import build_meta_model, read_config
from moe_offload.model.inventory import from_config, inventory, layer_of
from moe_offload.formats.layouts import map_keys
from moe_offload.model.published import DEEPSEEK_V3, GPT_OSS_120B, MIXTRAL_8X7B, QWEN3_30B_A3B
from moe_offload.model.roles import Role, assign

from conftest import TINY, tiny_config_dict

B = 10**9

# Full-size configs: moe_offload.model.published holds each model's published hyper-parameters.


def _params(plan, role):
    return plan.roles()[role.value]["params"]


def test_gpt_oss_120b_counts(write_config):
    plan = mo.plan(write_config(GPT_OSS_120B))
    # OpenAI, gpt-oss-120b model card, table 1: 116.83B total, 5.13B active per token (to 0.01B).
    assert abs(plan.total_params - 116.83 * B) <= 0.005 * B
    assert abs(plan.active_params - 5.13 * B) <= 0.005 * B
    # By hand, per layer: experts 128 x (2880*5760 + 5760 + 2880*2880 + 2880) = 3,186,155,520;
    # attention q,o 2880x4096 (+biases), k,v 2880x512 (+biases), 64 sinks = 26,550,144;
    # router 128x2880 + 128 = 368,768; 2 norms 5,760. Plus embedding and head 201088x2880 each, final norm.
    layer = 3_186_155_520 + 26_550_144 + 368_768 + 5_760
    assert plan.total_params == 36 * layer + 2 * 201088 * 2880 + 2880 == 116_829_156_672
    # Active: all but the input embedding; experts at 4/128.
    assert plan.active_params == 116_829_156_672 - 201088 * 2880 - 36 * 3_186_155_520 * 124 // 128
    # MXFP4 experts: 4.25 bits per parameter (4-bit values, one 8-bit scale per 32), biases and the
    # rest stay bf16.
    experts = [t for t in plan.tensors if t.role == "routed_expert" and t.name.endswith("_proj")]
    assert len(experts) == 72 and {t.dtype for t in experts} == {"mxfp4"}
    assert sum(t.bytes for t in experts) * 8 == sum(t.numel for t in experts) * 4.25
    assert {t.dtype for t in plan.tensors if t.role != "routed_expert"} == {"bfloat16"}


def test_mixtral_8x7b_counts(write_config):
    plan = mo.plan(write_config(MIXTRAL_8X7B))
    # By hand: experts 32 layers x 8 x 3 x 4096 x 14336 = 45,097,156,608; attention 32 x (2 x 4096^2 +
    # 2 x 1024 x 4096) = 1,342,177,280; routers 32 x 8 x 4096 = 1,048,576; norms 65 x 4096 = 266,240;
    # embedding and head 32000 x 4096 = 131,072,000 each.
    assert plan.total_params == 45_097_156_608 + 1_342_177_280 + 1_048_576 + 266_240 + 2 * 131_072_000
    assert plan.active_params == 45_097_156_608 // 4 + 1_342_177_280 + 1_048_576 + 266_240 + 131_072_000
    # Mistral AI, "Mixtral of experts" (2023-12-11): 46.7B total, 12.9B used per token. Mistral's 12.9B
    # counts the input embedding table too (12.88B with it, 12.75B without).
    assert abs(plan.total_params - 46.7 * B) <= 0.05 * B
    assert abs(plan.active_params + _params(plan, Role.EMBEDDING) - 12.9 * B) <= 0.05 * B


def test_qwen3_30b_a3b_counts(write_config):
    plan = mo.plan(write_config(QWEN3_30B_A3B))
    # Qwen3-30B-A3B model card: 30.5B in total, 3.3B activated, 29.9B non-embedding (embedding + head).
    assert abs(plan.total_params - 30.5 * B) <= 0.05 * B
    tables = _params(plan, Role.EMBEDDING) + _params(plan, Role.LM_HEAD)
    assert tables == 2 * 151936 * 2048
    assert abs(plan.total_params - tables - 29.9 * B) <= 0.05 * B
    # Qwen's 3.3B counts the input embedding (3.35B with it, truncated to one decimal).
    activated = plan.active_params + _params(plan, Role.EMBEDDING)
    assert 3.3 * B <= activated < 3.4 * B
    # Routed experts are 128 x 48 layers x 3 x 2048 x 768; each token reads 8/128 of them.
    assert _params(plan, Role.ROUTED_EXPERT) == 128 * 48 * 3 * 2048 * 768


def test_deepseek_v3_counts(write_config):
    plan = mo.plan(write_config(DEEPSEEK_V3))
    # DeepSeek-V3 technical report: 671B total, 37B activated per token. The Hugging Face release holds
    # 685B: the 671B main model plus the 14B multi-token-prediction module transformers does not build.
    assert abs(plan.total_params - 671 * B) <= 0.005 * 671 * B
    assert not any(t.layer is not None and t.layer >= 61 for t in plan.tensors)
    assert abs(plan.active_params - 37 * B) <= 0.5 * B
    # 58 MoE layers x 256 experts x 3 x 7168 x 2048; 1 shared expert of the same shape per MoE layer.
    assert _params(plan, Role.ROUTED_EXPERT) == 58 * 256 * 3 * 7168 * 2048
    assert _params(plan, Role.SHARED_EXPERT) == 58 * 3 * 7168 * 2048
    # 3 dense layers (first_k_dense_replace) x 3 x 7168 x 18432.
    assert _params(plan, Role.DENSE_MLP) == 3 * 3 * 7168 * 18432


# ---------------------------------------------------------------------------------------
# Storage bytes


def _fp8_deepseek(**extra):
    # DeepSeek-V3 shape at hidden 256: fp8 block [128,128] needs dims past one block to count scales.
    return tiny_config_dict("deepseek_v3", hidden_size=256, moe_intermediate_size=128, intermediate_size=384,
                            dtype="bfloat16", quantization_config={
                                "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": [128, 128]}, **extra)


def test_fp8_block_quantization_bytes(write_config):
    inv = inventory(write_config(_fp8_deepseek()))
    by = inv.by_name()
    roles = dict(zip((r.name for r in inv.records), assign(inv)))

    def rec(name):
        return by[name].dtype, by[name].bytes

    # Experts of layer 1 (4 experts, hidden 256, moe_intermediate 128): 1 byte per value + one float32
    # scale per 128x128 block.
    # gate_up [4, 256, 256]: 262,144 + 4 x 2 x 2 scales x 4 B = 262,208
    assert rec("model.layers.1.mlp.experts.gate_up_proj") == ("float8_e4m3fn", 262_144 + 64)
    # down [4, 256, 128]: 131,072 + 4 x 2 x 1 x 4 B = 131,104
    assert rec("model.layers.1.mlp.experts.down_proj") == ("float8_e4m3fn", 131_072 + 32)
    # shared expert gate [128, 256]: 32,768 + 1 x 2 x 4 B
    assert rec("model.layers.1.mlp.shared_experts.gate_proj.weight") == ("float8_e4m3fn", 32_768 + 8)
    # dense FFN of layer 0, gate [384, 256]: 98,304 + 3 x 2 x 4 B
    assert rec("model.layers.0.mlp.gate_proj.weight") == ("float8_e4m3fn", 98_304 + 24)
    # attention q_a [12, 256]: 3,072 + 1 x 2 x 4 B (a partial block still has a scale)
    assert rec("model.layers.0.self_attn.q_a_proj.weight") == ("float8_e4m3fn", 3_072 + 8)
    # Unquantized: embedding and head bf16 [64, 256] = 32,768 B (DeepSeek-V3 ships lm_head in bf16);
    # norms bf16 [256] = 512 B.
    assert rec("model.embed_tokens.weight") == ("bfloat16", 32_768)
    assert rec("lm_head.weight") == ("bfloat16", 32_768)
    assert rec("model.layers.1.input_layernorm.weight") == ("bfloat16", 512)
    assert rec("model.norm.weight") == ("bfloat16", 512)
    # The router [4, 256] and its correction bias are never fp8; transformers holds both in float32.
    assert rec("model.layers.1.mlp.gate.weight") == ("float32", 4_096)
    assert rec("model.layers.1.mlp.gate.e_score_correction_bias") == ("float32", 16)
    quantized_roles = {roles[r.name] for r in inv.records if r.dtype == "float8_e4m3fn"}
    assert quantized_roles == {Role.ROUTED_EXPERT, Role.SHARED_EXPERT, Role.ATTENTION, Role.DENSE_MLP}


def test_fp8_modules_to_not_convert_is_honoured(write_config):
    cfg = _fp8_deepseek()
    cfg["quantization_config"]["modules_to_not_convert"] = ["model.layers.0.self_attn"]
    by = inventory(write_config(cfg)).by_name()
    assert by["model.layers.0.self_attn.q_a_proj.weight"].dtype == "bfloat16"
    assert by["model.layers.1.self_attn.q_a_proj.weight"].dtype == "float8_e4m3fn"
    # A given list replaces transformers' default skips: lm_head [64, 256] is fp8 with 1 x 2 scales.
    assert (by["lm_head.weight"].dtype, by["lm_head.weight"].bytes) == ("float8_e4m3fn", 16_384 + 8)


def _mxfp4_gpt_oss():
    return tiny_config_dict("gpt_oss", hidden_size=64, intermediate_size=32, dtype="bfloat16", quantization_config={
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                            "model.embed_tokens", "lm_head"]})


def test_mxfp4_experts_at_4_25_bits(write_config):
    by = inventory(write_config(_mxfp4_gpt_oss())).by_name()
    # gate_up [4, 64, 64] = 16,384 params x 4.25 bits = 8,704 B; down [4, 32, 64] = 8,192 x 4.25 / 8 = 4,352 B
    assert (by["model.layers.0.mlp.experts.gate_up_proj"].dtype, by["model.layers.0.mlp.experts.gate_up_proj"].bytes) \
        == ("mxfp4", 8_704)
    assert by["model.layers.1.mlp.experts.down_proj"].bytes == 4_352
    # Expert biases [4, 64] and the router [4, 64] stay bf16: 512 B each.
    assert (by["model.layers.0.mlp.experts.gate_up_proj_bias"].dtype,
            by["model.layers.0.mlp.experts.gate_up_proj_bias"].bytes) == ("bfloat16", 512)
    assert (by["model.layers.0.mlp.router.weight"].dtype, by["model.layers.0.mlp.router.weight"].bytes) == \
        ("bfloat16", 512)
    assert by["lm_head.weight"].dtype == "bfloat16"


@pytest.mark.parametrize("dtype, itemsize, name", [("fp16", 2, "float16"), ("fp32", 4, "float32"),
                                                   ("bf16", 2, "bfloat16"), (None, 2, "bfloat16")])
def test_dtype_override(write_config, dtype, itemsize, name):
    folder = write_config(tiny_config_dict("qwen3_moe", dtype="bfloat16"))
    inv = inventory(folder, dtype=dtype)
    assert {r.dtype for r in inv.records} == {name}
    assert all(r.bytes == r.numel * itemsize for r in inv.records)
    # qwen3_moe tiny: 25 tensors; experts per layer 4 x (32x32 + 32x16) = 6,144 params
    assert sum(r.numel for r in inv.records if ".experts." in r.name) == 2 * 6_144
    plan = mo.plan(folder, dtype=dtype)
    assert plan.total_bytes == plan.total_params * itemsize


def test_unknown_dtype_is_a_config_error(write_config):
    with pytest.raises(ConfigError, match="fp8.*bf16, fp16 or fp32"):
        inventory(write_config(tiny_config_dict("qwen3_moe")), dtype="fp8")


# ---------------------------------------------------------------------------------------
# Checkpoint headers == config


@pytest.mark.parametrize("family, kw", [
    ("qwen3_moe", {}), ("mixtral", {}), ("gpt_oss", {}), ("granitemoe", {}), ("phimoe", {}), ("qwen2_moe", {}),
    ("qwen3_vl_moe", {}), ("llama4", {}), ("jamba", {}),
    ("deepseek_v3", {"dtype": "bfloat16"}),                   # its router stays float32 in memory and on disk
    ("qwen3_moe", {"max_shard_size": "20KB", "name": "sharded"}),
], ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}={x}" for k, x in v.items()) or "default")
def test_checkpoint_inventory_equals_config_inventory(save_tiny, family, kw):
    folder = save_tiny(family, **kw)
    if "max_shard_size" in kw:
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
    ckpt = inventory(folder)
    conf = inventory(folder / "config.json")
    assert (ckpt.source, conf.source) == ("checkpoint", "config")
    assert ckpt.records == conf.records
    assert (ckpt.num_experts, ckpt.top_k, ckpt.tied) == (conf.num_experts, conf.top_k, conf.tied)
    # The bytes are the files' tensor bytes: each safetensors header's data size, summed.
    on_disk = 0
    for f in folder.glob("*.safetensors"):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        on_disk += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    assert sum(r.bytes for r in ckpt.records) == on_disk


def _rewrite(folder, fn):
    path = folder / "model.safetensors"
    tensors = fn(load_file(path))
    save_file(tensors, path, metadata={"format": "pt"})


def test_fp8_checkpoint_headers_match_the_config_rule(save_tiny):
    """A DeepSeek-V3-layout fp8 checkpoint: per-expert fp8 weights, each with a float32 `weight_scale_inv`."""
    cfg = _fp8_deepseek()
    q = cfg.pop("quantization_config")
    folder = save_tiny("deepseek_v3", dtype="bfloat16", hidden_size=256, moe_intermediate_size=128,
                       intermediate_size=384)

    def to_fp8(sd):
        out = {}
        for k, v in sd.items():
            if k.endswith(("proj.weight", "proj_with_mqa.weight")):   # every nn.Linear but the head
                out[k] = v.to(torch.float8_e4m3fn)
                out[k + "_scale_inv"] = torch.ones(math.ceil(v.shape[0] / 128), math.ceil(v.shape[1] / 128))
            else:
                out[k] = v
        return out

    _rewrite(folder, to_fp8)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": q}))
    ckpt = inventory(folder)
    assert ckpt.source == "checkpoint"
    assert ckpt.records == from_config(folder).records
    assert ckpt.by_name()["model.layers.1.mlp.experts.gate_up_proj"].bytes == 262_144 + 64


def test_mxfp4_checkpoint_headers_match_the_config_rule(save_tiny):
    """gpt-oss layout: `*_blocks` [E, rows, cols/32, 16] uint8 + `*_scales` [E, rows, cols/32] uint8."""
    q = _mxfp4_gpt_oss()["quantization_config"]
    folder = save_tiny("gpt_oss", dtype="bfloat16", hidden_size=64, intermediate_size=32)

    def to_mxfp4(sd):
        out = {}
        for k, v in sd.items():
            if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
                w = v.transpose(1, 2)                      # stored [E, out, in]
                e, rows, cols = w.shape
                out[k + "_blocks"] = torch.zeros(e, rows, cols // 32, 16, dtype=torch.uint8)
                out[k + "_scales"] = torch.zeros(e, rows, cols // 32, dtype=torch.uint8)
            else:
                out[k] = v
        return out

    _rewrite(folder, to_mxfp4)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": q}))
    ckpt = inventory(folder)
    assert ckpt.records == from_config(folder).records
    rec = ckpt.by_name()["model.layers.0.mlp.experts.gate_up_proj"]
    assert (rec.dtype, rec.bytes) == ("mxfp4", 8_192 + 512)   # blocks + scales of 16,384 values


def test_released_qwen3_vl_layout_is_transposed_on_load(save_tiny):
    """Qwen3-VL-MoE releases store experts [E, H, 2I]; save_pretrained writes the in-memory [E, 2I, H]."""
    folder = save_tiny("qwen3_vl_moe")
    _rewrite(folder, lambda sd: {k: (v.transpose(1, 2).contiguous() if ".experts." in k else v)
                                 for k, v in sd.items()})
    ckpt = inventory(folder)
    assert ckpt.records == inventory(folder / "config.json").records
    model = build_meta_model(read_config(folder))
    key = "model.language_model.layers.0.mlp.experts.down_proj"
    slot = map_keys(model, [key])[key]
    assert slot.target == key and slot.transpose == (1, 2) and slot.transpose_if_needed


def test_tied_checkpoint_that_still_stores_the_head(save_tiny):
    folder = save_tiny("qwen3_moe", tie_word_embeddings=True)
    _rewrite(folder, lambda sd: {**sd, "lm_head.weight": sd["model.embed_tokens.weight"].clone()})
    inv = inventory(folder)
    names = [r.name for r in inv.records]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names


# ---------------------------------------------------------------------------------------
# Layouts: checkpoint names -> in-memory slots


def _meta(family):
    from transformers import AutoConfig

    return build_meta_model(AutoConfig.for_model(family, **TINY[family]))


def test_layout_qwen_per_expert_to_fused():
    model = _meta("qwen3_moe")
    keys = ["model.layers.0.mlp.experts.3.up_proj.weight", "model.layers.0.mlp.experts.3.gate_proj.weight",
            "model.layers.1.mlp.experts.2.down_proj.weight", "model.layers.0.mlp.gate.weight"]
    slots = map_keys(model, keys)
    up = slots[keys[0]]
    assert (up.target, up.expert, up.part, up.parts, up.part_dim) == (
        "model.layers.0.mlp.experts.gate_up_proj", 3, 1, 2, 0)
    gate = slots[keys[1]]
    assert (gate.target, gate.expert, gate.part, gate.parts) == ("model.layers.0.mlp.experts.gate_up_proj", 3, 0, 2)
    down = slots[keys[2]]
    assert (down.target, down.expert, down.parts) == ("model.layers.1.mlp.experts.down_proj", 2, 1)
    assert slots[keys[3]].is_whole and slots[keys[3]].target == keys[3]


def test_layout_mixtral_block_sparse_moe():
    slots = map_keys(_meta("mixtral"), ["model.layers.0.block_sparse_moe.experts.1.w2.weight",
                                        "model.layers.0.block_sparse_moe.experts.1.w3.weight",
                                        "model.layers.0.block_sparse_moe.gate.weight"])
    w2 = slots["model.layers.0.block_sparse_moe.experts.1.w2.weight"]
    assert (w2.target, w2.expert, w2.parts) == ("model.layers.0.mlp.experts.down_proj", 1, 1)
    w3 = slots["model.layers.0.block_sparse_moe.experts.1.w3.weight"]   # w1 is gate, w3 is up
    assert (w3.target, w3.expert, w3.part, w3.parts) == ("model.layers.0.mlp.experts.gate_up_proj", 1, 1, 2)
    assert slots["model.layers.0.block_sparse_moe.gate.weight"].target == "model.layers.0.mlp.gate.weight"


def test_layout_granitemoe_input_linear():
    slots = map_keys(_meta("granitemoe"), ["model.layers.0.block_sparse_moe.input_linear.weight",
                                           "model.layers.0.block_sparse_moe.output_linear.weight",
                                           "model.layers.0.block_sparse_moe.router.layer.weight"])
    inp = slots["model.layers.0.block_sparse_moe.input_linear.weight"]
    assert inp.target == "model.layers.0.block_sparse_moe.experts.gate_up_proj" and inp.is_whole
    assert slots["model.layers.0.block_sparse_moe.output_linear.weight"].target == \
        "model.layers.0.block_sparse_moe.experts.down_proj"
    assert slots["model.layers.0.block_sparse_moe.router.layer.weight"].target == \
        "model.layers.0.block_sparse_moe.router.weight"


def test_layer_of():
    assert layer_of("model.layers.17.mlp.experts.down_proj") == 17
    assert layer_of("model.language_model.layers.3.self_attn.q_proj.weight") == 3
    assert layer_of("model.embed_tokens.weight") is None
    assert layer_of("lm_head.weight") is None


# ---------------------------------------------------------------------------------------
# Bad input


def test_missing_config(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        inventory(tmp_path)
    with pytest.raises(ConfigError, match="does not exist"):
        inventory(tmp_path / "nowhere")


def test_malformed_json(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_moe",')
    with pytest.raises(ConfigError, match="not valid JSON"):
        inventory(tmp_path)


def test_config_without_model_type(write_config):
    with pytest.raises(ConfigError, match="no 'model_type'"):
        inventory(write_config({"hidden_size": 32, "num_hidden_layers": 2}))


def test_unknown_model_type_without_known_architecture(write_config):
    with pytest.raises(ConfigError, match="unknown model_type 'mystery_moe'.*MysteryForCausalLM"):
        inventory(write_config({"model_type": "mystery_moe", "architectures": ["MysteryForCausalLM"]}))
    with pytest.raises(ConfigError, match="unknown model_type 'mystery_moe'"):
        inventory(write_config({"model_type": "mystery_moe"}, name="noarch"))


def test_invalid_field_is_a_config_error(write_config):
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        inventory(write_config({"model_type": "qwen3_moe", "num_hidden_layers": "two"}))


def test_kimi_k2_builds_as_deepseek_v3_with_a_note(write_config):
    cfg = tiny_config_dict("deepseek_v3")
    cfg.update(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"],
               auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                         "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})
    inv = inventory(write_config(cfg))
    assert inv.model_type == "deepseek_v3" and (inv.num_experts, inv.top_k) == (4, 2)
    assert any("kimi_k2" in n and "DeepseekV3ForCausalLM" in n for n in inv.notes)
    assert "model.layers.1.mlp.experts.gate_up_proj" in inv.by_name()
    assert any("kimi_k2" in n for n in mo.plan(write_config(cfg, name="again")).notes)


def test_index_naming_a_missing_shard(save_tiny):
    folder = save_tiny("qwen3_moe", max_shard_size="20KB")
    shards = sorted(folder.glob("model-*.safetensors"))
    os.remove(shards[1])
    with pytest.raises(CheckpointError, match=f"{shards[1].name}.*missing"):
        inventory(folder)


def test_truncated_safetensors(save_tiny):
    folder = save_tiny("qwen3_moe")
    path = folder / "model.safetensors"
    os.truncate(path, path.stat().st_size - 100)
    with pytest.raises(CheckpointError, match="model.safetensors.*truncated"):
        inventory(folder)


def test_checkpoint_tensor_that_matches_nothing(save_tiny):
    folder = save_tiny("qwen3_moe")
    _rewrite(folder, lambda sd: {**sd, "model.layers.0.mlp.bogus.weight": torch.zeros(2, 2)})
    with pytest.raises(CheckpointError, match="model.layers.0.mlp.bogus.weight"):
        inventory(folder)


@pytest.mark.parametrize("drop, shown", [
    ("model.norm.weight", "model.norm.weight"),
    # One expert of a per-expert layout: the fused tensor would silently hold 3 of 4 experts.
    ("model.layers.1.mlp.experts.2.down_proj.weight", "model.layers.1.mlp.experts.down_proj"),
])
def test_missing_tensor(save_tiny, drop, shown):
    folder = save_tiny("qwen3_moe")
    _rewrite(folder, lambda sd: {k: v for k, v in sd.items() if k != drop})
    with pytest.raises(CheckpointError, match=f"in no checkpoint file.*{shown}"):
        inventory(folder)


def test_checkpoint_tensor_of_the_wrong_shape(save_tiny):
    folder = save_tiny("qwen3_moe")
    # expert up_proj must be [moe_intermediate 16, hidden 32]
    _rewrite(folder, lambda sd: {**sd, "model.layers.0.mlp.experts.1.up_proj.weight": torch.zeros(32, 16)})
    with pytest.raises(CheckpointError, match="wrong shape.*experts.1.up_proj.weight \\[32, 16\\].*\\[16, 32\\]"):
        inventory(folder)


def test_fp8_fused_gate_up_with_small_intermediate(write_config):
    # moe_intermediate 64: gate and up are [64, 256] each, one row block apiece: 2 row blocks per expert,
    # where one grid over the fused 128 rows would count just 1.
    cfg = _fp8_deepseek()
    cfg["moe_intermediate_size"] = 64
    by = inventory(write_config(cfg)).by_name()
    # gate_up [4, 128, 256]: 131,072 + 4 x 2 x 1 x 2 x 4 B = 131,136
    assert by["model.layers.1.mlp.experts.gate_up_proj"].bytes == 131_072 + 64


def test_fp8_modules_to_not_convert_patterns(write_config):
    cfg = _fp8_deepseek()
    cfg["quantization_config"]["modules_to_not_convert"] = ["lm_head", "model.layers.*.self_attn"]
    by = inventory(write_config(cfg)).by_name()
    assert by["model.layers.0.self_attn.q_a_proj.weight"].dtype == "bfloat16"
    assert by["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"].dtype == "bfloat16"
    assert by["model.layers.1.mlp.experts.down_proj"].dtype == "float8_e4m3fn"


def test_a_live_module_real_or_meta_plans_like_its_config(write_config):
    """moe_offload.plan accepts an nn.Module: a real one (with weights) and a meta one give the config's plan."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = write_config(tiny_config_dict("qwen3_moe"))
    config = AutoConfig.from_pretrained(folder)
    real = AutoModelForCausalLM.from_config(config)          # weights allocated on the CPU
    meta = build_meta_model(config)
    expected = mo.plan(folder, offload_gb=4096 / 2**30)
    for module in (real, meta):
        p = mo.plan(module, offload_gb=4096 / 2**30)
        assert p.tiers == expected.tiers and p.total_bytes == expected.total_bytes
        assert p.total_params == expected.total_params == sum(x.numel() for x in real.parameters())


@pytest.mark.parametrize("quantization, shown", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),          # was planned as unquantized bf16
    ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [0, 128]},
     "weight_block_size [0, 128]"),                                        # was a ZeroDivisionError
    ({"quant_method": "fp8", "fmt": "e5m2", "activation_scheme": "dynamic"}, "fmt 'e5m2'"),
])
def test_a_quantization_the_planner_cannot_size_is_an_error_not_a_guess(write_config, quantization, shown):
    # Planning from config.json alone reads the same quantization_config the loader reads (quant.spec_from_config):
    # a method or block size it cannot size is a user error, never a plan at another precision.
    cfg = _fp8_deepseek()
    cfg["quantization_config"] = quantization
    with pytest.raises(CheckpointError, match=re.escape(shown)):
        inventory(write_config(cfg))
