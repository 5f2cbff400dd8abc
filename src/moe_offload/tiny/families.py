"""The model families make-tiny writes, as data: each family's config fields, Auto class and quirks.

`family_config(family, sizes)` is the config a tiny model of `family` gets: the fields every family shares,
then the family's own row of `FIELDS` (which maps the generic sizes onto the family's field names, beside
fixed values), then the fields that depend on more than one size (layer counts, MLA ranks: `_DERIVED`).
Qwen3-VL-MoE nests these text fields under `text_config`, beside a small vision tower. The routers'
limits (`MIN_EXPERTS`, `EXACT_TOP_K`) and the families written quantized (`QUANT_FAMILIES`, `quant_skips`)
are here too; make.py checks the arguments against them. So are the attention rules heads.py applies
(`HEAD_DIM_FIELD`, `KV_HEADS_ARE_HEADS`) and the expert tensors stored as released (`RELEASED_TRANSPOSED`).

Where a tiny model could depart from the released ones, it follows them, as llama.cpp's converter and
loader expect them (the comments at each row say what and where): OLMoE's key/value heads, DeepSeek-V2's
compressed queries, DeepSeek's scoring_func, Qwen3-VL-MoE's expert orientation on disk.
"""

from __future__ import annotations

import copy
import enum
from typing import Any, Callable

__all__ = ["FAMILIES", "AUTO_CLASSES", "QUANT_FAMILIES", "MIN_EXPERTS", "EXACT_TOP_K", "HEADS", "MAX_POSITIONS",
           "HEAD_DIM_FIELD", "KV_HEADS_ARE_HEADS", "RELEASED_TRANSPOSED", "Size", "family_config", "size_fields",
           "quant_skips"]

# Attention heads of a tiny model unless make-tiny is given --heads / --kv-heads / --head-dim (heads.py
# resolves them). Four heads with two KV heads exercises grouped-query attention while keeping the
# per-head size reasonable at hidden=64.
HEADS = 4
# Short context: the tiny models only ever see prompts of a few dozen tokens, and the
# rotary/position tables then stay negligible next to the expert weights.
MAX_POSITIONS = 512


class Size(enum.Enum):
    """A generic size of the tiny model, which each family's config names its own way (make.py sets them)."""

    EXPERTS = "experts"
    TOP_K = "top_k"
    HEADS = "heads"
    HEAD_DIM = "head_dim"
    EXPERT_FFN = "expert_ffn"   # 1.5 * hidden
    DENSE_FFN = "dense_ffn"     # 2 * hidden


E, K, H, HD, XF, DF = Size.EXPERTS, Size.TOP_K, Size.HEADS, Size.HEAD_DIM, Size.EXPERT_FFN, Size.DENSE_FFN

# --- one row of config fields per family ---------------------------------------------------
# Each maps the generic (experts, top_k, hidden) onto the family's own field names: a Size is
# that size, anything else is the value itself. Expert FFNs are 1.5*hidden wide and dense FFNs
# 2*hidden, so routed experts hold most of the parameters, as in real MoE checkpoints, and no
# expert matrix is square: a transposed expert weight then always shows up as a shape mismatch
# instead of silently loading.
FIELDS: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(head_dim=HD, intermediate_size=DF, moe_intermediate_size=XF, num_experts=E,
                      num_experts_per_tok=K,
                      norm_topk_prob=True),  # as in the released Qwen3 MoE checkpoints
    # Qwen2-MoE always has exactly one (gated) shared expert; keep it so planners see the
    # shared_expert role.
    "qwen2_moe": dict(intermediate_size=DF, moe_intermediate_size=XF, shared_expert_intermediate_size=DF,
                      num_experts=E, num_experts_per_tok=K),
    # Mixtral has no dense FFN: intermediate_size is each expert's width.
    "mixtral": dict(head_dim=HD, intermediate_size=XF, num_local_experts=E, num_experts_per_tok=K),
    # DeepSeek-V3: MLA (see _deepseek_mla), group-limited routing with one group: valid for any
    # expert count, still runs the group-selection code path. scoring_func is no field of transformers'
    # config (its router is always sigmoid) but released config.json files carry it, and llama.cpp's
    # converter reads it (TextModel.set_gguf_parameters: scoring_func -> expert_gating_func; its loader
    # falls back to softmax without it). topk_method "noaux_tc" as released: transformers' router always is,
    # and vLLM builds the router's e_score_correction_bias only with it.
    "deepseek_v3": dict(num_key_value_heads=H,  # MLA has no grouped KV heads
                        intermediate_size=DF, moe_intermediate_size=XF, n_routed_experts=E,
                        num_experts_per_tok=K, n_shared_experts=1, n_group=1, topk_group=1,
                        scoring_func="sigmoid", topk_method="noaux_tc"),
    "gpt_oss": dict(
        head_dim=HD,
        intermediate_size=XF,  # gpt-oss has only expert FFNs
        num_local_experts=E,
        num_experts_per_tok=K,
        # Shorter than the prompts used in tests, so the sliding layers really slide.
        sliding_window=16,
        # Keep gpt-oss's YaRN rope, rescaled to the tiny context.
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": MAX_POSITIONS // 4,
        },
    ),
    # The text model's fields (nested under text_config by _with_vision); the VL text config has
    # no norm_topk_prob (always normalised).
    "qwen3_vl_moe": dict(head_dim=HD, intermediate_size=DF, moe_intermediate_size=XF, num_experts=E,
                         num_experts_per_tok=K, model_type="qwen3_vl_moe_text"),
    # OLMoE: intermediate_size is the expert width (no dense FFN). As many KV heads as query heads, as in
    # the released OLMoE-1B-7B (16 and 16): its q_norm / k_norm span the whole projection, and llama.cpp
    # sizes attn_k_norm as the hidden size.
    "olmoe": dict(intermediate_size=XF, num_key_value_heads=H, num_experts=E, num_experts_per_tok=K),
    "phimoe": dict(intermediate_size=XF, num_local_experts=E, num_experts_per_tok=K),
    "granitemoe": dict(intermediate_size=XF, num_local_experts=E, num_experts_per_tok=K),
    # Full DeepSeek-V2 style (DeepSeek-V2 / -V2.5 / Coder-V2, not -Lite): compressed queries (q_lora_rank,
    # _deepseek_q_lora) and group-limited greedy routing, here over one group (valid for any expert count; the
    # group-selection code path still runs). llama.cpp reads the Lite layout (no q_lora_rank) only from
    # checkpoints of Lite's 26/27 layers, so a 2-layer Lite could not load there.
    "deepseek_v2": dict(num_key_value_heads=H,  # MLA has no grouped KV heads
                        intermediate_size=DF, moe_intermediate_size=XF, n_routed_experts=E,
                        num_experts_per_tok=K, n_shared_experts=1, topk_method="group_limited_greedy",
                        n_group=1, topk_group=1, scoring_func="softmax"),  # as released (see deepseek_v3)
    "glm4_moe": dict(head_dim=HD, intermediate_size=DF, moe_intermediate_size=XF, n_routed_experts=E,
                     num_experts_per_tok=K, n_shared_experts=1, n_group=1, topk_group=1),
    "qwen3_next": dict(head_dim=HD, intermediate_size=DF, moe_intermediate_size=XF,
                       shared_expert_intermediate_size=XF, num_experts=E, num_experts_per_tok=K,
                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=HD,
                       linear_value_head_dim=HD),
    "jamba": dict(intermediate_size=XF, num_experts=E, num_experts_per_tok=K, attn_layer_offset=0,
                  mamba_d_state=8),
}

FAMILIES: tuple[str, ...] = tuple(FIELDS)

# Families whose attention head size is a config field of its own, so hidden need not be heads x head_dim
# (Qwen3-30B-A3B: hidden 2048, 32 heads of 128; gpt-oss: 2880, 64 of 64): the ones whose row writes
# head_dim. DeepSeek's MLA sizes its heads by qk_nope/qk_rope/v_head_dim (_deepseek_mla), never by hidden:
# make-tiny's head_dim sets those. Every other family's transformers, vLLM and llama.cpp code takes a
# head as hidden / heads wide.
HEAD_DIM_FIELD: frozenset[str] = frozenset(
    [f for f, row in FIELDS.items() if row.get("head_dim") is HD] + ["deepseek_v3", "deepseek_v2"])

# Families whose key/value heads are always as many as the query heads, and why.
KV_HEADS_ARE_HEADS: dict[str, str] = {
    "deepseek_v3": "multi-head latent attention has no grouped key/value heads",
    "deepseek_v2": "multi-head latent attention has no grouped key/value heads",
    "olmoe": "released OLMoE has as many key/value heads as query heads, and its q_norm/k_norm (and llama.cpp's "
             "attn_k_norm) span the hidden size",
}

# Fused expert tensors that released checkpoints store transposed from what transformers holds in memory,
# and so from what its save_pretrained writes (its reverse of `Transpose(check_dims=True)` keeps the in-memory
# shape). Released Qwen3-VL-30B-A3B stores `experts.gate_up_proj` [E, H, 2I] and `down_proj` [E, I, H];
# transformers' conversion mapping for qwen3_vl_moe transposes them to [E, 2I, H] / [E, H, I] at load, and
# llama.cpp's converter (Qwen3VLMoeTextModel) splits gate_up_proj along its last dim, expecting [E, H, 2I].
# make-tiny writes them as released (released.py).
RELEASED_TRANSPOSED: dict[str, tuple[str, ...]] = {
    "qwen3_vl_moe": (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"),
}

# The transformers Auto class that loads each family for text generation. transformers 5.x
# registers Qwen3-VL-MoE only under image-text-to-text (Qwen3VLMoeForConditionalGeneration),
# not under AutoModelForCausalLM; it still generates from text-only input.
AUTO_CLASSES: dict[str, str] = {
    f: ("AutoModelForImageTextToText" if f == "qwen3_vl_moe" else "AutoModelForCausalLM")
    for f in FAMILIES
}


def size_fields(family: str, size: Size) -> list[str]:
    """The config fields (of the text config, for qwen3_vl_moe) that hold `size` in `family`'s models:
    `size_fields("qwen2_moe", Size.DENSE_FFN)` == ["intermediate_size", "shared_expert_intermediate_size"]."""
    return [name for name, value in FIELDS[family].items() if value is size]


# --- fields that depend on more than one size ----------------------------------------------


def _first_dense(p: dict[str, Any]) -> dict[str, Any]:
    # One leading dense layer, like the real models, whenever there is room for an MoE layer after it.
    return dict(first_k_dense_replace=1 if p["layers"] >= 2 else 0)


def _deepseek_mla(p: dict[str, Any]) -> dict[str, Any]:
    """Multi-head latent attention sizes shared by DeepSeek-V2 and -V3."""
    hd = p["head_dim"]
    return dict(kv_lora_rank=p["hidden"] // 2, qk_nope_head_dim=hd, qk_rope_head_dim=hd // 2, v_head_dim=hd,
                **_first_dense(p))


def _deepseek_q_lora(p: dict[str, Any]) -> dict[str, Any]:
    """Compressed queries, as the released DeepSeek-V3 and full DeepSeek-V2 have (q_lora_rank 1536)."""
    return dict(_deepseek_mla(p), q_lora_rank=p["hidden"] // 2)


def _qwen3_vl_moe(p: dict[str, Any]) -> dict[str, Any]:
    half = p["head_dim"] // 2
    # Interleaved M-RoPE splits the rotary half-dimension over (time, height, width);
    # the sections must add up to head_dim // 2 (Qwen uses 24/20/20 of 64).
    mrope = [half - 2 * (half // 4), half // 4, half // 4]
    return dict(rope_parameters={
        "rope_type": "default",
        "rope_theta": 5000000.0,
        "mrope_section": mrope,
        "mrope_interleaved": True,
    })


def _qwen3_next(p: dict[str, Any]) -> dict[str, Any]:
    layers = p["layers"]
    # Alternate linear (gated delta-net) and full attention so that even a 2-layer
    # model has both kinds; the real model uses one full layer in four. A 1-layer model
    # gets a full-attention layer: transformers' hybrid cache cannot generate without one.
    return dict(layer_types=(
        ["full_attention"]
        if layers == 1
        else ["linear_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    ))


def _jamba(p: dict[str, Any]) -> dict[str, Any]:
    two = p["layers"] >= 2
    # Real Jamba: attention in 1 layer of 8, MoE every 2nd layer. Shrink the periods so
    # a 2-layer model has one attention + one Mamba layer, and at least one MoE layer.
    return dict(attn_layer_period=2 if two else 1, expert_layer_period=2 if two else 1,
                expert_layer_offset=1 if two else 0)


_DERIVED: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "deepseek_v3": _deepseek_q_lora,
    "deepseek_v2": _deepseek_q_lora,
    "glm4_moe": _first_dense,
    "qwen3_vl_moe": _qwen3_vl_moe,
    "qwen3_next": _qwen3_next,
    "jamba": _jamba,
}


def _common(p: dict[str, Any]) -> dict[str, Any]:
    """Config fields every family shares (all of them accept these names)."""
    return dict(
        vocab_size=p["vocab_size"],
        hidden_size=p["hidden"],
        num_hidden_layers=p["layers"],
        num_attention_heads=p["heads"],
        num_key_value_heads=p["kv_heads"],
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=p["init_std"],
        tie_word_embeddings=False,
        bos_token_id=p["bos"],
        eos_token_id=p["eos"],
        pad_token_id=p["pad"],
    )


def _with_vision(text: dict[str, Any], p: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-VL-MoE's config: the text fields under text_config, a two-block vision tower, the vision token ids."""
    vision_hidden = max(16, p["hidden"] // 2)
    vision = dict(
        model_type="qwen3_vl_moe_vision",
        depth=2,
        hidden_size=vision_hidden,
        intermediate_size=2 * vision_hidden,
        num_heads=2,
        patch_size=16,
        temporal_patch_size=2,
        spatial_merge_size=2,
        out_hidden_size=p["hidden"],
        num_position_embeddings=64,  # must be a square (an 8x8 grid of learned positions)
        deepstack_visual_indexes=[0],
        initializer_range=p["init_std"],
    )
    vt = p["vision_token_ids"]
    return dict(
        text_config=text,
        vision_config=vision,
        vision_start_token_id=vt["<|vision_start|>"],
        vision_end_token_id=vt["<|vision_end|>"],
        image_token_id=vt["<|image_pad|>"],
        video_token_id=vt["<|video_pad|>"],
        tie_word_embeddings=False,
        bos_token_id=p["bos"],
        eos_token_id=p["eos"],
        pad_token_id=p["pad"],
    )


def family_config(family: str, p: dict[str, Any]) -> dict[str, Any]:
    """The config fields of a tiny `family` model of sizes `p` (make.py's params), for AutoConfig.for_model."""
    # Fixed values are copied: transformers may normalise a nested dict (rope_parameters) in place.
    own = {k: p[v.value] if isinstance(v, Size) else copy.deepcopy(v) for k, v in FIELDS[family].items()}
    config = dict(_common(p), **own)
    config.update(_DERIVED.get(family, lambda p: {})(p))
    return _with_vision(config, p) if family == "qwen3_vl_moe" else config


# --- router limits and quantized checkpoints -----------------------------------------------

# Families whose router needs more than the generic 1 <= top_k <= experts.
MIN_EXPERTS = {
    # Group-limited routing scores each group by its top-2 experts (torch.topk(2)).
    "deepseek_v3": 2,
    "glm4_moe": 2,
}
EXACT_TOP_K = {
    # PhiMoE's sparsemixer router is hard-wired to pick exactly two experts.
    "phimoe": 2,
}

# Families whose tiny checkpoints can be written quantized: those transformers itself loads in that
# format (gpt-oss is the only MXFP4 family; FP8 needs per-expert matrices on disk, which its
# dequantizing loader reads).
QUANT_FAMILIES: dict[str, tuple[str, ...]] = {
    "fp8": ("qwen3_moe", "deepseek_v3", "qwen2_moe", "mixtral", "olmoe", "glm4_moe"),
    "mxfp4": ("gpt_oss",),
}


def quant_skips(family: str, layers: int, quant: str) -> list[str] | None:
    """`modules_to_not_convert` in the style each family's released quantized config uses."""
    if quant == "mxfp4":  # gpt-oss: only the experts are MXFP4
        return ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
    if family == "deepseek_v3":
        return None  # DeepSeek-V3 ships no list: transformers' default keeps the LM head unquantized
    # In the style of Qwen3-FP8: the LM head, plus every layer's norms and router gate by name.
    per_layer = ("input_layernorm", "mlp.gate", "post_attention_layernorm")
    return ["lm_head", *(f"model.layers.{i}.{m}" for i in range(layers) for m in per_layer), "model.norm"]
