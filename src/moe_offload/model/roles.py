"""Roles: what each tensor is, by whole dot-separated name segments and its module's class.

Never by substring: `shared_expert`, `shared_experts`, `shared_expert_gate`, `shared_mlp`,
`mlp.gate` (a router), `router`, `e_score_correction_bias`, `moe_statics` and `expert_bias`
are not routed experts, while `experts.3.gate_proj.weight` (on disk),
`experts.gate_up_proj` (in memory) and a fused parameter registered as `mlp.experts`
itself are.
"""

from __future__ import annotations

from enum import Enum

from .inventory import Inventory, TensorRecord


class Role(str, Enum):
    ROUTED_EXPERT = "routed_expert"
    SHARED_EXPERT = "shared_expert"
    ROUTER = "router"
    EMBEDDING = "embedding"
    LM_HEAD = "lm_head"
    ATTENTION = "attention"
    NORM = "norm"
    DENSE_MLP = "dense_mlp"
    OTHER = "other"


# Families whose names these rules were checked against (tests/test_roles.py).
KNOWN_FAMILIES = frozenset({
    "qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_vl_moe", "qwen3_vl_moe_text", "mixtral", "olmoe", "deepseek_v2",
    "deepseek_v3", "kimi_k2", "gpt_oss", "glm4_moe", "llama4", "llama4_text", "phimoe", "granitemoe", "jamba",
    "llama", "qwen3", "qwen2", "mistral",
})

_EXPERTS = {"experts"}
_SHARED = {"shared_expert", "shared_experts", "shared_mlp", "shared_expert_gate"}
_ROUTER = {"router", "e_score_correction_bias", "expert_bias", "moe_statics"}
_MOE_BLOCKS = {"mlp", "block_sparse_moe", "feed_forward", "moe", "ffn"}
_EMBED = {"embed_tokens", "wte", "word_embeddings", "tok_embeddings", "embed_in"}
_LM_HEAD = {"lm_head", "embed_out"}
_ATTENTION = {"self_attn", "attn", "attention", "cross_attn", "linear_attn", "mixer", "mamba", "self_attention"}
_DENSE = {"mlp", "feed_forward", "ffn", "dense"}


def _is_norm(seg: str) -> bool:
    # `input_layernorm`, `q_norm`, `norm1`, `ln_f`, `layer_norm`: norm names end in a norm word.
    base = seg.rstrip("0123456789_")
    return base.endswith("norm") or base in {"ln", "ln_f"} or base.startswith("ln_")


def classify(record: TensorRecord, *, tied_head: bool = False) -> Role:
    """The role of one tensor. `tied_head`: this is the input embedding tied to the LM head."""
    segs = record.name.split(".")
    modules = segs[:-1]  # the last segment is the tensor's own name (weight, bias, gate_up_proj, ...)
    seg_set = set(segs)
    if tied_head:
        return Role.LM_HEAD  # one tensor, read in full by every token as the LM head
    if seg_set & _SHARED:
        return Role.SHARED_EXPERT
    # A router module's class ends in Router/Gate (`Qwen3MoeTopKRouter`, DeepSeek's `MoEGate`); a substring
    # test would also catch Qwen3-Next's linear attention (`Qwen3NextGatedDeltaNet`, `Qwen3NextRMSNormGated`).
    if seg_set & _ROUTER or record.module_class.endswith(("Router", "Gate")):
        return Role.ROUTER
    # A whole segment anywhere, the tensor's own name included: some model code registers the fused expert
    # weights as one parameter named `experts` (`mlp.experts`), with no experts module around it.
    if _EXPERTS & seg_set:
        return Role.ROUTED_EXPERT
    # `mlp.gate.weight` (Qwen, Mixtral, DeepSeek): the router, a module named exactly `gate` in an MoE block.
    for parent, seg in zip(modules, modules[1:]):
        if seg == "gate" and parent in _MOE_BLOCKS:
            return Role.ROUTER
    if seg_set & _LM_HEAD:
        return Role.LM_HEAD
    if record.component == "language" and (seg_set & _EMBED or record.module_class.endswith("Embedding")) \
            and len(record.shape) == 2:
        return Role.EMBEDDING
    if any(_is_norm(s) for s in modules) or "Norm" in record.module_class:
        return Role.NORM
    if seg_set & _ATTENTION:
        return Role.ATTENTION
    if seg_set & _DENSE:
        return Role.DENSE_MLP
    return Role.OTHER


def assign(inv: Inventory) -> tuple[Role, ...]:
    """Roles of every record of an inventory, aligned with `inv.records`."""
    tied_targets = {target for alias, target in inv.tied if set(alias.split(".")) & _LM_HEAD}
    return tuple(classify(r, tied_head=r.name in tied_targets) for r in inv.records)


def family_note(inv: Inventory) -> str | None:
    if inv.model_type in KNOWN_FAMILIES:
        return None
    return (f"model type {inv.model_type!r} is not one moe-offload's role rules were checked on; roles follow the "
            "generic name rules (check the roles table)")
