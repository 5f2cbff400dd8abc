"""Hand-built inventories for the planner, tier and replay tests: every byte count derived by hand.

Toy MoE layer used throughout (bfloat16, 2 bytes per element; hidden 8, E=4 experts, top-k 2):

    model.layers.L.input_layernorm.weight            (8,)       16 B   norm
    model.layers.L.self_attn.q_proj.weight           (8, 8)    128 B   attention
    model.layers.L.self_attn.o_proj.weight           (8, 8)    128 B   attention
    model.layers.L.post_attention_layernorm.weight   (8,)       16 B   norm
    model.layers.L.mlp.gate.weight                   (4, 8)     64 B   router
    model.layers.L.mlp.experts.gate_up_proj          (4, 8, 8) 512 B   routed expert
    model.layers.L.mlp.experts.down_proj             (4, 8, 4) 256 B   routed expert
                                                              -----
                                                     layer   1120 B   (experts 768 B, dense 352 B)

Around the layers: model.embed_tokens.weight (16, 8) 256 B (vocab 16: density 1/16),
model.norm.weight (8,) 16 B, lm_head.weight (16, 8) 256 B.
Routed-expert density at batch b: 1 - (1 - 2/4)^b = 1/2 at b=1, 15/16 at b=4.
"""

from __future__ import annotations

import math

from moe_offload.model.inventory import Inventory, TensorRecord, component_of, layer_of
from moe_offload.planning.placement import GiB, Plan

ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def record(name, shape, dtype="bfloat16", module_class="", is_buffer=False) -> TensorRecord:
    return TensorRecord(name, tuple(shape), dtype, math.prod(shape) * ITEMSIZE[dtype], layer_of(name),
                        component_of(name), module_class, is_buffer)


def make_inv(specs, *, experts=4, top_k=2, tied=(), model_type="qwen3_moe") -> Inventory:
    """An Inventory from (name, shape[, dtype[, module_class[, is_buffer]]]) tuples, in declaration order."""
    return Inventory(tuple(record(*s) for s in specs), model_type, experts, top_k, tuple(tied))


def layer(i: int) -> list[tuple]:
    p = f"model.layers.{i}"
    return [
        (f"{p}.input_layernorm.weight", (8,), "bfloat16", "Qwen3MoeRMSNorm"),        # 16 B
        (f"{p}.self_attn.q_proj.weight", (8, 8), "bfloat16", "Linear"),              # 128 B
        (f"{p}.self_attn.o_proj.weight", (8, 8), "bfloat16", "Linear"),              # 128 B
        (f"{p}.post_attention_layernorm.weight", (8,), "bfloat16", "Qwen3MoeRMSNorm"),  # 16 B
        (f"{p}.mlp.gate.weight", (4, 8), "bfloat16", "Linear"),                      # 64 B
        (f"{p}.mlp.experts.gate_up_proj", (4, 8, 8), "bfloat16", "Qwen3MoeExperts"),  # 512 B
        (f"{p}.mlp.experts.down_proj", (4, 8, 4), "bfloat16", "Qwen3MoeExperts"),     # 256 B
    ]


EMBED = ("model.embed_tokens.weight", (16, 8), "bfloat16", "Embedding")   # 256 B
FINAL_NORM = ("model.norm.weight", (8,), "bfloat16", "Qwen3MoeRMSNorm")   # 16 B
LM_HEAD = ("lm_head.weight", (16, 8), "bfloat16", "Linear")               # 256 B


def full_model(layers: int = 1, tied: bool = False) -> Inventory:
    """embed + layers + norm (+ lm_head unless tied). 1 layer untied: 256 + 1120 + 16 + 256 = 1648 B."""
    specs = [EMBED, *[s for i in range(layers) for s in layer(i)], FINAL_NORM]
    if tied:  # named_parameters() lists a tied tensor once, under its first name
        return make_inv(specs, tied=(("lm_head.weight", "model.embed_tokens.weight"),))
    return make_inv(specs + [LM_HEAD])


def gb(nbytes: int) -> float:
    """A byte count as GiB, exactly (GiB is a power of two)."""
    return nbytes / GiB


def host(p: Plan) -> list[str]:
    return [t.name for t in p.tensors if t.tier == "host"]


def expert_names(layers) -> list[str]:
    return [f"model.layers.{i}.mlp.experts.{w}" for i in layers for w in ("gate_up_proj", "down_proj")]


def dense_layer(i: int) -> list[tuple]:
    p = f"model.layers.{i}"
    return [
        (f"{p}.input_layernorm.weight", (8,)),        # 16 B
        (f"{p}.self_attn.q_proj.weight", (8, 8)),     # 128 B
        (f"{p}.mlp.gate_proj.weight", (16, 8)),       # 256 B
        (f"{p}.mlp.down_proj.weight", (8, 16)),       # 256 B
    ]                                                 # 656 B per layer


def with_buffer() -> Inventory:
    # + a persistent router buffer: (4,) float32, 16 B, 4 elements that are not parameters.
    specs = [EMBED, *layer(0), ("model.layers.0.mlp.gate.e_score_correction_bias", (4,), "float32",
                                "DeepseekV3TopkRouter", True), FINAL_NORM, LM_HEAD]
    return make_inv(specs)
