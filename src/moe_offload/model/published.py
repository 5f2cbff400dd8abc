"""Hyper-parameters of released MoE models, as their makers publish them in config.json.

For planning without their files (nothing is downloaded): the tests check parameter
counts against the makers' published totals, and the benchmarks plan at full size.
`write(name, folder)` writes one as a config.json that `moe_offload.plan` reads.
"""

from __future__ import annotations

import json
from pathlib import Path

GPT_OSS_120B = dict(
    model_type="gpt_oss", architectures=["GptOssForCausalLM"], hidden_size=2880, intermediate_size=2880,
    num_hidden_layers=36, num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=128,
    num_experts_per_tok=4, vocab_size=201088, tie_word_embeddings=False, sliding_window=128,
    max_position_embeddings=131072, layer_types=["sliding_attention", "full_attention"] * 18, dtype="bfloat16",
    quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]})
MIXTRAL_8X7B = dict(
    model_type="mixtral", architectures=["MixtralForCausalLM"], hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
    vocab_size=32000, max_position_embeddings=32768, tie_word_embeddings=False, dtype="bfloat16")
QWEN3_30B_A3B = dict(
    model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=2048, intermediate_size=6144,
    moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    num_experts=128, num_experts_per_tok=8, vocab_size=151936, max_position_embeddings=40960,
    tie_word_embeddings=False, dtype="bfloat16")
DEEPSEEK_V3 = dict(
    model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], hidden_size=7168, intermediate_size=18432,
    moe_intermediate_size=2048, num_hidden_layers=61, first_k_dense_replace=3, num_attention_heads=128,
    num_key_value_heads=128, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8,
    topk_group=4, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    vocab_size=129280, max_position_embeddings=163840, tie_word_embeddings=False, dtype="bfloat16",
    num_nextn_predict_layers=1,
    quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                         "weight_block_size": [128, 128]})

# moonshotai/Kimi-K2-Instruct config.json (published hyper-parameters; MTP layers: 0).
KIMI_K2 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    "model_type": "kimi_k2",
    "vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_nextn_predict_layers": 0, "num_attention_heads": 64, "num_key_value_heads": 64,
    "n_shared_experts": 1, "n_routed_experts": 384, "routed_scaling_factor": 2.827, "num_experts_per_tok": 8,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc",
    "scoring_func": "sigmoid", "norm_topk_prob": True,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 50000.0,
    "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
                     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": 163584, "eos_token_id": 163585,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]},
}

CONFIGS = {
    "gpt-oss-120b": GPT_OSS_120B,
    "mixtral-8x7b": MIXTRAL_8X7B,
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "deepseek-v3": DEEPSEEK_V3,
    "kimi-k2": KIMI_K2,
}


def write(name: str, folder) -> Path:
    """Write CONFIGS[name] as folder/config.json; returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIGS[name]))
    return folder
