"""Shared fixtures: tiny configs of real transformers families, written to tmp folders.

Every model a test sees is written by the test itself: nothing is fetched from a hub.
`tiny_config(family)` gives a small but valid config (hidden 32, 2 layers, 4 experts,
top-k 2) of a transformers family; `write_config` writes a config.json; `save_tiny`
builds the model with random weights and `save_pretrained`s it, so the checkpoint's
names and layout are exactly what transformers writes for that family.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

H = 32  # hidden size of every tiny language model
_BASE = dict(hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
             max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_MLA = dict(kv_lora_rank=8, q_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, head_dim=4,
            n_group=1, topk_group=1)

# Expert FFNs 16 wide, dense FFNs 48, shared experts 24: no two kinds of matrix share a shape.
TINY: dict[str, dict] = {
    "qwen2_moe": dict(_BASE, intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                      num_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(_BASE, intermediate_size=48, moe_intermediate_size=16, head_dim=8, num_experts=4,
                      num_experts_per_tok=2),
    "qwen3_next": dict(_BASE, intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                       head_dim=8, num_experts=4, num_experts_per_tok=2, linear_key_head_dim=8,
                       linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                       layer_types=["linear_attention", "full_attention"]),
    "mixtral": dict(_BASE, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(_BASE, intermediate_size=16, num_experts=4, num_experts_per_tok=2),
    "deepseek_v2": dict(_BASE, **_MLA, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4,
                        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1),
    "deepseek_v3": dict(_BASE, **_MLA, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4,
                        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1),
    "gpt_oss": dict(_BASE, intermediate_size=16, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                    layer_types=["sliding_attention", "full_attention"]),
    "glm4_moe": dict(_BASE, intermediate_size=48, moe_intermediate_size=16, head_dim=8, n_routed_experts=4,
                     n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1),
    # Layer 0 dense, layer 1 MoE (interleaved, as Llama-4 Maverick).
    "llama4_text": dict(_BASE, intermediate_size=16, intermediate_size_mlp=48, head_dim=8, num_local_experts=4,
                        num_experts_per_tok=1, moe_layers=[1], interleave_moe_layer_step=2,
                        layer_types=["chunked_attention", "full_attention"], no_rope_layers=[1, 0]),
    "phimoe": dict(_BASE, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2),
    "granitemoe": dict(_BASE, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2),
    # Layer 0: attention + dense FFN; layer 1: Mamba + MoE.
    "jamba": dict(_BASE, intermediate_size=16, num_experts=4, num_experts_per_tok=2, expert_layer_period=2,
                  expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=0, mamba_d_state=4, mamba_d_conv=4,
                  mamba_expand=2, mamba_dt_rank=4),
    "llama": dict(_BASE, intermediate_size=48, head_dim=8),
    "qwen3": dict(_BASE, intermediate_size=48, head_dim=8),
}
TINY["qwen3_vl_moe"] = dict(
    text_config=dict(TINY["qwen3_moe"], rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                         "mrope_section": [1, 1, 2]}),
    vision_config=dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=H, patch_size=2,
                       temporal_patch_size=2, spatial_merge_size=2, deepstack_visual_indexes=[0],
                       num_position_embeddings=16),
    tie_word_embeddings=False)
TINY["llama4"] = dict(
    text_config=TINY["llama4_text"],
    vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=8,
                       patch_size=4, projector_input_dim=16, projector_output_dim=16, vision_output_dim=16,
                       pixel_shuffle_ratio=0.5),
    tie_word_embeddings=False)

VISION_FAMILIES = ("qwen3_vl_moe", "llama4")


def tiny_config_dict(family: str, **overrides) -> dict:
    """A complete config.json dict of `family`, validated by its transformers config class."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(family, **{**TINY[family], **overrides})
    return config.to_dict()


def _write_config(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def _save_tiny(folder: Path, family: str, *, dtype: str = "float32", max_shard_size: str | None = None,
               seed: int = 0, **overrides) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.for_model(family, **{**TINY[family], **overrides})
    auto = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    torch.manual_seed(seed)
    model = auto.from_config(config, dtype=getattr(torch, dtype))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return folder


@pytest.fixture
def write_config(tmp_path):
    """write_config(dict, name="model") -> folder holding that config.json."""
    return lambda config, name="model": _write_config(tmp_path / name, config)


@pytest.fixture
def family_dir(tmp_path):
    """family_dir(family, **overrides) -> folder holding the tiny config.json of that family."""
    return lambda family, name=None, **overrides: _write_config(
        tmp_path / (name or family), tiny_config_dict(family, **overrides))


@pytest.fixture
def save_tiny(tmp_path):
    """save_tiny(family, dtype="float32", max_shard_size=None, **overrides) -> checkpoint folder."""
    return lambda family, name=None, **kw: _save_tiny(tmp_path / (name or family), family, **kw)


@pytest.fixture(autouse=True, scope="session")
def _torch_on_one_thread():
    """The whole suite runs torch on one CPU thread.

    The tiny models here do microseconds of work per op; with 2 OpenMP threads on a busy 2-core
    machine torch's thread hand-off dominates (index_add_ in the eager experts loop measured ~47 ms
    per call with 2 threads against ~47 us with 1), so one thread keeps the suite fast and stable.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --- tiny model folders of every make_tiny family, shared by test_loader.py and test_runtime.py ------------


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """family -> a tiny model folder (see fixtures_models.SIZES), made once per session."""
    from fixtures_models import make_models

    return make_models(tmp_path_factory)


@pytest.fixture(scope="session")
def plans0(models):
    """family -> its zero-budget plan (byte sizes and roles only), computed once."""
    import moe_offload as mo

    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = mo.plan(models[family])
        return cache[family]

    return get


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    """Nothing is ever fetched: transformers is told it has no network."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
