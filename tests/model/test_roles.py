"""Roles of the tensors of real transformers families, built on the meta device from tiny configs.

The expected roles below are written from reading each family's modeling file, name by
name, not from the rules in roles.py: a tensor whose name is not in these tables fails
the test, so a transformers rename has to be looked at by a person.
"""

from __future__ import annotations

import re

import pytest

from moe_offload.model.inventory import Inventory, TensorRecord, component_of, inventory
from moe_offload.model.roles import KNOWN_FAMILIES, Role, assign, classify, family_note

from conftest import TINY, VISION_FAMILIES

R, S, G = Role.ROUTED_EXPERT, Role.SHARED_EXPERT, Role.ROUTER
E, L, A, N, D, O = Role.EMBEDDING, Role.LM_HEAD, Role.ATTENTION, Role.NORM, Role.DENSE_MLP, Role.OTHER

# Language-model tensors: the name after `layers.<i>.`, or the top-level name without its
# `model.` / `language_model.` prefixes.
LANGUAGE = {
    "embed_tokens.weight": E,
    "lm_head.weight": L,
    "norm.weight": N, "norm.bias": N, "final_layernorm.weight": N,
    "input_layernorm.weight": N, "input_layernorm.bias": N, "pre_ff_layernorm.weight": N,
    "post_attention_layernorm.weight": N, "post_attention_layernorm.bias": N,
    # attention (MHA/GQA, Qwen3 q/k norms, gpt-oss sinks)
    "self_attn.q_proj.weight": A, "self_attn.k_proj.weight": A, "self_attn.v_proj.weight": A,
    "self_attn.o_proj.weight": A, "self_attn.q_proj.bias": A, "self_attn.k_proj.bias": A,
    "self_attn.v_proj.bias": A, "self_attn.o_proj.bias": A, "self_attn.sinks": A,
    "self_attn.q_norm.weight": N, "self_attn.k_norm.weight": N,
    # DeepSeek multi-head latent attention
    "self_attn.q_a_proj.weight": A, "self_attn.q_b_proj.weight": A, "self_attn.kv_a_proj_with_mqa.weight": A,
    "self_attn.kv_b_proj.weight": A, "self_attn.q_a_layernorm.weight": N, "self_attn.kv_a_layernorm.weight": N,
    # Qwen3-Next gated delta net (linear attention): its classes are named *Gated*, none is a router
    "linear_attn.A_log": A, "linear_attn.dt_bias": A, "linear_attn.conv1d.weight": A,
    "linear_attn.in_proj_qkvz.weight": A, "linear_attn.in_proj_ba.weight": A, "linear_attn.out_proj.weight": A,
    "linear_attn.norm.weight": N,
    # Jamba Mamba mixer (the sequence mixer of its non-attention layers)
    "mamba.A_log": A, "mamba.D": A, "mamba.conv1d.weight": A, "mamba.conv1d.bias": A, "mamba.in_proj.weight": A,
    "mamba.x_proj.weight": A, "mamba.dt_proj.weight": A, "mamba.dt_proj.bias": A, "mamba.out_proj.weight": A,
    "mamba.dt_layernorm.weight": N, "mamba.b_layernorm.weight": N, "mamba.c_layernorm.weight": N,
    # dense FFN (dense models, DeepSeek/GLM first_k_dense layers, Llama-4/Jamba non-MoE layers)
    "mlp.gate_proj.weight": D, "mlp.up_proj.weight": D, "mlp.down_proj.weight": D,
    "feed_forward.gate_proj.weight": D, "feed_forward.up_proj.weight": D, "feed_forward.down_proj.weight": D,
    # routed experts, fused in memory
    "mlp.experts.gate_up_proj": R, "mlp.experts.down_proj": R,
    "mlp.experts.gate_up_proj_bias": R, "mlp.experts.down_proj_bias": R,
    "feed_forward.experts.gate_up_proj": R, "feed_forward.experts.down_proj": R,
    "block_sparse_moe.experts.gate_up_proj": R, "block_sparse_moe.experts.down_proj": R,
    # routers: `mlp.gate` (Qwen, Mixtral, OLMoE, DeepSeek, GLM), `router` (gpt-oss, Phi, Granite, Jamba, Llama-4)
    "mlp.gate.weight": G, "mlp.gate.e_score_correction_bias": G,
    "mlp.router.weight": G, "mlp.router.bias": G, "feed_forward.router.weight": G,
    "block_sparse_moe.router.weight": G,
    # shared experts: read by every token
    "mlp.shared_expert.gate_proj.weight": S, "mlp.shared_expert.up_proj.weight": S,
    "mlp.shared_expert.down_proj.weight": S, "mlp.shared_expert_gate.weight": S,
    "mlp.shared_experts.gate_proj.weight": S, "mlp.shared_experts.up_proj.weight": S,
    "mlp.shared_experts.down_proj.weight": S,
    "feed_forward.shared_expert.gate_proj.weight": S, "feed_forward.shared_expert.up_proj.weight": S,
    "feed_forward.shared_expert.down_proj.weight": S,
}

# Vision towers: the name inside the tower with list indices as N. Patch/position embeddings,
# mergers and projectors are read in full for every image: `other` (or `dense_mlp` for an MLP).
DENSE_ANY = {O, D}
VISION = {
    # Qwen3-VL
    "patch_embed.proj.weight": {O}, "patch_embed.proj.bias": {O}, "pos_embed.weight": {O},
    "blocks.N.norm1.weight": {N}, "blocks.N.norm1.bias": {N}, "blocks.N.norm2.weight": {N},
    "blocks.N.norm2.bias": {N},
    "blocks.N.attn.qkv.weight": {A}, "blocks.N.attn.qkv.bias": {A}, "blocks.N.attn.proj.weight": {A},
    "blocks.N.attn.proj.bias": {A},
    "blocks.N.mlp.linear_fc1.weight": {D}, "blocks.N.mlp.linear_fc1.bias": {D},
    "blocks.N.mlp.linear_fc2.weight": {D}, "blocks.N.mlp.linear_fc2.bias": {D},
    "merger.norm.weight": {N}, "merger.norm.bias": {N},
    "merger.linear_fc1.weight": DENSE_ANY, "merger.linear_fc1.bias": DENSE_ANY,
    "merger.linear_fc2.weight": DENSE_ANY, "merger.linear_fc2.bias": DENSE_ANY,
    "deepstack_merger_list.N.norm.weight": {N}, "deepstack_merger_list.N.norm.bias": {N},
    "deepstack_merger_list.N.linear_fc1.weight": DENSE_ANY, "deepstack_merger_list.N.linear_fc1.bias": DENSE_ANY,
    "deepstack_merger_list.N.linear_fc2.weight": DENSE_ANY, "deepstack_merger_list.N.linear_fc2.bias": DENSE_ANY,
    # Llama-4 vision model and its projector
    "class_embedding": {O}, "positional_embedding_vlm": {O}, "patch_embedding.linear.weight": {O},
    "layernorm_pre.weight": {N}, "layernorm_pre.bias": {N}, "layernorm_post.weight": {N}, "layernorm_post.bias": {N},
    **{f"model.layers.N.self_attn.{p}_proj.{t}": {A} for p in "qkvo" for t in ("weight", "bias")},
    **{f"model.layers.N.{n}.{t}": {N} for n in ("input_layernorm", "post_attention_layernorm")
       for t in ("weight", "bias")},
    **{f"model.layers.N.mlp.fc{i}.{t}": {D} for i in (1, 2) for t in ("weight", "bias")},
    "vision_adapter.mlp.fc1.weight": {D}, "vision_adapter.mlp.fc2.weight": {D},
    "linear_1.weight": DENSE_ANY,   # multi_modal_projector
}
_TOWER_PREFIX = re.compile(r"^(model\.visual\.|vision_model\.|multi_modal_projector\.)")

MOE_FAMILIES = ["qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_vl_moe", "mixtral", "olmoe", "deepseek_v2",
                "deepseek_v3", "gpt_oss", "glm4_moe", "llama4_text", "llama4", "phimoe", "granitemoe", "jamba"]
DENSE_FAMILIES = ["llama", "qwen3"]
# Families with a shared expert in every MoE layer (qwen2_moe/qwen3_next `shared_expert`, DeepSeek/GLM
# `shared_experts`, Llama-4 `shared_expert`).
SHARED = {"qwen2_moe", "qwen3_next", "deepseek_v2", "deepseek_v3", "glm4_moe", "llama4_text", "llama4"}


def _language_key(name: str) -> str:
    m = re.search(r"(?:^|\.)layers\.\d+\.(.+)$", name)
    if m:
        return m.group(1)
    return re.sub(r"^(model\.language_model\.|language_model\.model\.|language_model\.|model\.)", "", name)


def _vision_key(name: str) -> str:
    return re.sub(r"\.\d+\.", ".N.", _TOWER_PREFIX.sub("", name))


def _classified(family_dir, family):
    inv = inventory(family_dir(family))
    return inv, assign(inv)


@pytest.mark.parametrize("family", MOE_FAMILIES + DENSE_FAMILIES)
def test_every_tensor_of_a_family_has_its_role(family_dir, family):
    inv, roles = _classified(family_dir, family)
    assert len(roles) == len(inv.records) > 0
    unreviewed, wrong = [], []
    for r, role in zip(inv.records, roles):
        if r.component == "vision":
            allowed = VISION.get(_vision_key(r.name))
        else:
            expected = LANGUAGE.get(_language_key(r.name))
            allowed = None if expected is None else {expected}
        if allowed is None:
            unreviewed.append(r.name)
        elif role not in allowed:
            wrong.append((r.name, role.value, sorted(a.value for a in allowed)))
    assert not unreviewed, f"{family}: tensors no test table covers (read them and add them): {unreviewed}"
    assert not wrong, f"{family}: wrong roles (name, got, expected): {wrong}"


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_routed_experts_are_exactly_the_experts_modules(family_dir, family):
    """Independent of the tables: routed experts are the tensors under an `experts` module, nothing else."""
    inv, roles = _classified(family_dir, family)
    routed = {r.name for r, role in zip(inv.records, roles) if role is R}
    under_experts = {r.name for r in inv.records if ".experts." in r.name}
    assert routed == under_experts
    # Every MoE layer holds fused experts [E, ., .] with E = 4 (tiny configs), gate_up and down.
    assert all(r.shape[0] == 4 for r in inv.records if r.name in routed and r.name.endswith(("_proj",)))
    moe_layers = {r.layer for r in inv.records if r.name in routed}
    expected_layers = {1} if family in ("deepseek_v2", "deepseek_v3", "glm4_moe", "llama4_text", "llama4",
                                        "jamba") else {0, 1}
    assert moe_layers == expected_layers
    # One router per MoE layer, at least.
    assert {r.layer for r, role in zip(inv.records, roles) if role is G} == expected_layers
    assert (inv.num_experts, inv.top_k) == (4, 1 if family.startswith("llama4") else 2)
    has_shared = any(role is S for role in roles)
    assert has_shared == (family in SHARED)


@pytest.mark.parametrize("family", DENSE_FAMILIES)
def test_dense_model_has_no_moe_roles(family_dir, family):
    inv, roles = _classified(family_dir, family)
    assert not {R, S, G} & set(roles)
    assert (inv.num_experts, inv.top_k) == (None, None)
    # 2 layers x (gate, up, down)
    assert sum(role is D for role in roles) == 6


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_vision_tower_is_never_sparse_nor_a_lookup_table(family_dir, family):
    inv, roles = _classified(family_dir, family)
    tower = [(r, role) for r, role in zip(inv.records, roles) if _TOWER_PREFIX.match(r.name)]
    assert tower, "the tiny config must build a vision tower"
    assert all(r.component == "vision" for r, _ in tower)
    assert not {role for _, role in tower} & {R, S, G, E, L}
    # The language model inside still has its one input embedding and its experts.
    lang_roles = [role for r, role in zip(inv.records, roles) if r.component == "language"]
    assert lang_roles.count(E) == 1 and lang_roles.count(L) == 1 and R in lang_roles


# ---------------------------------------------------------------------------------------
# Hand-made names: the false positives a substring rule falls into


def _rec(name, shape=(4, 32), module_class="Linear", component=None):
    nbytes = 2 * (shape[0] if len(shape) == 1 else shape[0] * shape[-1])
    return TensorRecord(name, tuple(shape), "bfloat16", nbytes, 0, component or component_of(name), module_class)


@pytest.mark.parametrize("name, module_class, role", [
    ("model.layers.0.mlp.shared_expert.gate_proj.weight", "Linear", S),         # Qwen2-MoE, Qwen3-Next
    ("model.layers.0.mlp.shared_experts.up_proj.weight", "Linear", S),          # DeepSeek, GLM-4.5
    ("model.layers.0.mlp.shared_expert_gate.weight", "Linear", S),              # Qwen2-MoE shared-expert gate
    ("model.layers.0.mlp.shared_mlp.down_proj.weight", "Linear", S),            # HunYuan
    ("model.layers.0.mlp.gate.weight", "Linear", G),                            # router as a plain nn.Linear
    ("model.layers.0.block_sparse_moe.gate.weight", "Linear", G),               # Mixtral on disk
    ("model.layers.0.mlp.router.weight", "GptOssTopKRouter", G),
    ("model.layers.0.mlp.gate.e_score_correction_bias", "DeepseekV3TopkRouter", G),
    ("model.layers.0.mlp.moe_statics.e_score_correction_bias", "Ernie4_5_MoeStatics", G),
    ("model.layers.0.mlp.expert_bias", "SomeMoeBlock", G),
    ("model.layers.0.mlp.gate.weight", "MoEGate", G),                           # DeepSeek remote code
    ("model.layers.0.linear_attn.A_log", "Qwen3NextGatedDeltaNet", A),          # "Gate" in a class name
    ("model.layers.0.linear_attn.norm.weight", "Qwen3NextRMSNormGated", N),
    ("model.layers.0.mlp.gate_proj.weight", "Linear", D),                       # `gate_proj` is not `gate`
])
def test_not_routed_experts(name, module_class, role):
    r = _rec(name, (4,) if name.endswith(("bias", "A_log")) or "norm" in name else (4, 32), module_class)
    assert classify(r) is role
    assert classify(r) is not R


@pytest.mark.parametrize("name, shape, module_class", [
    ("model.layers.3.mlp.experts.3.gate_proj.weight", (16, 32), "Linear"),           # per-expert, on disk
    ("model.layers.3.mlp.experts.gate_up_proj", (4, 32, 32), "Qwen3MoeExperts"),     # fused, in memory
    ("model.layers.3.mlp.experts.down_proj_bias", (4, 32), "GptOssExperts"),
    ("model.layers.0.block_sparse_moe.experts.1.w2.weight", (32, 48), "Linear"),     # Mixtral on disk
    ("model.layers.1.feed_forward.experts.gate_up_proj", (4, 32, 32), "Llama4TextExperts"),
])
def test_routed_experts(name, shape, module_class):
    assert classify(_rec(name, shape, module_class)) is R


@pytest.mark.parametrize("name, module_class", [
    ("model.visual.pos_embed.weight", "Embedding"),                                       # Qwen3-VL
    ("model.vision_tower.embed_tokens.weight", "Embedding"),                              # a tower's own table
    ("model.vision_tower.vision_model.embeddings.position_embedding.weight", "Embedding"),  # SigLIP (Gemma-3)
    ("vision_model.patch_embedding.linear.weight", "Linear"),                             # Llama-4
])
def test_vision_tower_tables_are_not_embeddings(name, module_class):
    assert component_of(name) == "vision"
    role = classify(_rec(name, (16, 16), module_class))
    assert role is not E and role is not R


def test_untied_input_embedding_is_embedding_and_head_is_lm_head():
    assert classify(_rec("model.embed_tokens.weight", (64, 32), "Embedding")) is E
    assert classify(_rec("model.language_model.embed_tokens.weight", (64, 32), "Embedding")) is E
    assert classify(_rec("lm_head.weight", (64, 32))) is L
    assert classify(_rec("language_model.lm_head.weight", (64, 32))) is L


@pytest.mark.parametrize("family", ["qwen3_moe", "llama", "mixtral"])
def test_tied_embeddings_are_one_lm_head_tensor(family_dir, family):
    inv = inventory(family_dir(family, tie_word_embeddings=True))
    roles = assign(inv)
    table = [(r, role) for r, role in zip(inv.records, roles) if role in (E, L)]
    # One tensor of [vocab 64, hidden 32], read in full by every token as the head.
    assert [(r.name, r.shape, role) for r, role in table] == [("model.embed_tokens.weight", (64, 32), L)]
    assert ("lm_head.weight", "model.embed_tokens.weight") in inv.tied
    assert not any(r.name == "lm_head.weight" for r in inv.records)


def test_unknown_family_is_noted_and_known_ones_are_not(write_config):
    from transformers import AutoConfig

    # MiniMax is a transformers MoE family the role rules were not checked on.
    cfg = AutoConfig.for_model("minimax", hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64,
                               num_local_experts=4, num_experts_per_tok=2,
                               layer_types=["linear_attention", "full_attention"]).to_dict()
    inv = inventory(write_config(cfg))
    assert inv.model_type == "minimax" and "minimax" not in KNOWN_FAMILIES
    note = family_note(inv)
    assert note is not None and "'minimax'" in note and "not" in note
    # It still classifies by the generic rules: experts, routers.
    roles = assign(inv)
    assert {r.name for r, role in zip(inv.records, roles) if role is R} == {
        f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("gate_up_proj", "down_proj")}

    for family in ("qwen3_moe", "deepseek_v3", "gpt_oss"):
        assert family_note(Inventory((), family, 4, 2)) is None
    assert "mystery" in family_note(Inventory((), "mystery_moe", None, None))


def test_every_checked_family_is_known():
    assert set(MOE_FAMILIES + DENSE_FAMILIES) <= KNOWN_FAMILIES
    assert set(TINY) <= KNOWN_FAMILIES


# ---------------------------------------------------------------------------------------
# A fused expert parameter registered under the name `experts` itself (issue 7)


@pytest.mark.parametrize("name, module_class, role", [
    ("model.layers.0.mlp.experts", "FusedSparseMoeBlock", R),           # nn.Parameter registered as mlp.experts
    ("model.layers.0.block_sparse_moe.experts", "SparseMoeBlock", R),
    ("model.layers.0.mlp.shared_experts", "FusedSparseMoeBlock", S),    # the segment is shared_experts: shared
    ("model.layers.0.mlp.expert", "FusedSparseMoeBlock", D),            # `expert` is not the segment `experts`
])
def test_a_parameter_named_experts_is_a_routed_expert(name, module_class, role):
    assert classify(_rec(name, (4, 32, 16), module_class)) is role


def test_budget_only_offloader_offloads_a_fused_experts_parameter_before_any_dense_tensor():
    """Before the fix `mlp.experts` classified dense, and the Offloader spilled norms and attention first."""
    import torch
    import torch.nn as nn

    from moe_offload import Offloader

    def layers():
        for _ in range(2):
            layer = nn.Module()
            layer.input_layernorm = nn.LayerNorm(32)                           # 2 x 32 x 4 B = 256 B
            layer.self_attn = nn.Module()
            layer.self_attn.q_proj = nn.Linear(32, 32, bias=False)             # 32 x 32 x 4 B = 4096 B
            layer.mlp = nn.Module()
            layer.mlp.experts = nn.Parameter(torch.zeros(4, 32, 16))            # 4 x 32 x 16 x 4 B = 8192 B
            yield layer

    off = Offloader(offload_gb=8192 / 2 ** 30, device="cpu")   # exactly one layer's experts
    off.wrap_modules(layers())
    off.finalize()
    assert {n for n, tier in off.tiers().items() if tier == "host"} == {"0.mlp.experts"}
    assert off.offloaded_bytes == 8192
