"""Config checks: the fields that size a model, validated before anything is built.

transformers builds whatever a config.json says. `vocab_size` 0 fails deep inside the
embedding constructor, `num_experts_per_tok` 99 of 8 experts builds and plans nonsense
(more active than total parameters), and `num_hidden_layers` 10^12 builds modules until
memory runs out. Two passes, both before the meta model exists, each raising one
ConfigError that names the field, its value and the fix:

- `check_raw(raw, path)`: the JSON as written, before a transformers config class sees it
  (config classes expand per-layer lists from `num_hidden_layers`, so a huge count must
  never reach them): every sizing field present is an integer in its range.
- `check_config(config, path)`: the config transformers resolved, defaults filled in: the
  fields that must agree with each other (top-k within the experts, query heads in whole
  KV groups, group-limited routing, ...) and the parameter count, bounded.

Both walk nested sub-configs (`text_config`, `vision_config`, ...). Field names follow the
families' own config.json vocabulary; the same name means the same thing in every family.
Imports nothing heavy: pass 1 refuses a malformed config before transformers reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from ..errors import ConfigError

# Config fields that name the routed-expert count and the top-k, across families (first match wins).
EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOPK_FIELDS = ("num_experts_per_tok", "moe_topk", "experts_per_token", "top_k")

MAX_LAYERS = 1024          # the deepest published models have about 130 layers
MAX_EXPERTS = 4096         # published MoE models have at most 512 routed experts per layer
MAX_HEADS = 1 << 16        # published models have at most 128 attention heads
MAX_DIM = 1 << 24          # any one tensor dimension; published vocabularies and widths stay below 2**18
MAX_PARAMS = 10 ** 13      # ten times the largest published MoE models (about 1e12 parameters)


@dataclass(frozen=True)
class _Range:
    fields: tuple[str, ...]
    low: int
    high: int | None
    why: str


_RANGES = (
    _Range(("num_hidden_layers", "depth", "num_layers"), 1, MAX_LAYERS,
           f"a model has at least one layer, and moe-offload builds at most {MAX_LAYERS} "
           "(the deepest published models have about 130)"),
    _Range(("vocab_size",), 1, MAX_DIM, f"the embedding table has one row per token, at least 1 and at most {MAX_DIM}"),
    _Range(("max_position_embeddings",), 1, None, "the context holds at least one position"),
    _Range(("hidden_size", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
            "intermediate_size_mlp", "head_dim", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
            "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "mamba_d_state",
            "mamba_d_conv", "mamba_expand", "mamba_dt_rank", "patch_size",
            "temporal_patch_size", "spatial_merge_size", "out_hidden_size", "num_position_embeddings",
            "image_size", "projector_input_dim", "projector_output_dim", "vision_output_dim", "in_channels",
            "num_channels"), 1, MAX_DIM, f"a tensor dimension is at least 1 and at most {MAX_DIM}"),
    _Range(("num_attention_heads", "num_key_value_heads", "num_heads", "linear_num_key_heads",
            "linear_num_value_heads"), 1, MAX_HEADS,
           f"attention has at least one head and at most {MAX_HEADS} (published models have at most 128)"),
    _Range(EXPERT_FIELDS, 1, MAX_EXPERTS,
           f"an MoE layer routes among at least one expert, and moe-offload plans at most {MAX_EXPERTS} per "
           "layer (published models have at most 512)"),
    _Range(TOPK_FIELDS, 1, None, "each token is routed to at least one expert"),
    _Range(("decoder_sparse_step", "moe_layer_freq", "expert_layer_period", "attn_layer_period",
            "interleave_moe_layer_step", "n_group", "topk_group"), 1, None,
           "a layer period or group count is at least 1 (the model divides by it)"),
    _Range(("first_k_dense_replace", "num_nextn_predict_layers", "expert_layer_offset", "attn_layer_offset"), 0,
           None, "a count of layers is never negative"),
    _Range(("n_shared_experts",), 0, MAX_EXPERTS, f"a count of experts is between 0 and {MAX_EXPERTS}"),
    _Range(("qk_nope_head_dim",), 0, MAX_DIM, f"a head's width without rotary part is between 0 and {MAX_DIM}"),
)
_RULE = {name: rule for rule in _RANGES for name in rule.fields}
# (offset, period): layer i has the feature when i % period == offset, so an offset >= period never matches (Jamba).
_OFFSETS = (("expert_layer_offset", "expert_layer_period"), ("attn_layer_offset", "attn_layer_period"))
# Values a field may hold besides an integer (transformers resolves them itself).
_WORDS = {"mamba_dt_rank": ("auto",)}
# Families whose router always picks experts inside groups, scoring each group by its best 2 experts
# (DeepSeek-V2 does so only with topk_method "group_limited_greedy", scoring a group by its best one).
_TOP2_GROUPED = {"deepseek_v3", "glm4_moe", "kimi_k2"}


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _routing_topk_fields(present, has_experts: bool) -> tuple[str, ...]:
    """The top-k fields of a section that are the router's.

    `top_k` is also a sampling option that old config.json files carry (50, or 0 for "off"): it is the
    router's top-k only in an MoE config where no other top-k field exists, as config.routing_of reads it.
    """
    named = tuple(f for f in TOPK_FIELDS[:-1] if f in present)
    return named or (("top_k",) if "top_k" in present and has_experts else ())


# ---------------------------------------------------------------------------------------
# Pass 1: the JSON as written


def _raw_sections(raw: dict, prefix: str = "") -> Iterator[tuple[str, dict]]:
    yield prefix, raw
    for key, value in raw.items():
        if isinstance(value, dict) and key.endswith("_config") and key != "quantization_config":
            yield from _raw_sections(value, f"{prefix}{key}.")


def check_raw(raw: dict, path) -> None:
    """Every sizing field of a config.json (and of its nested sub-configs) is an integer in its range."""
    for prefix, section in _raw_sections(raw):
        routing_topk = _routing_topk_fields(section, any(f in section for f in EXPERT_FIELDS))
        for name, value in section.items():
            rule = _RULE.get(name)
            if rule is None or value is None or (name in TOPK_FIELDS and name not in routing_topk):
                continue  # null: transformers derives the value (head_dim, num_key_value_heads, q_lora_rank)
            # Some families give a size per layer or per axis (`image_size: [448, 448]`): each entry must fit.
            for item in value if isinstance(value, list) else [value]:
                if item in _WORDS.get(name, ()):
                    continue
                if not _int(item):
                    raise ConfigError(f"{path}: {prefix}{name}={value!r} is not an integer: {rule.why}; write it as "
                                      "a JSON integer")
                if item < rule.low or (rule.high is not None and item > rule.high):
                    bound = f"between {rule.low} and {rule.high}" if rule.high is not None else f">= {rule.low}"
                    raise ConfigError(f"{path}: {prefix}{name}={value} is out of range: {rule.why}; set it {bound}")
        for offset, period in _OFFSETS:
            if _int(section.get(offset)) and _int(section.get(period)) and section[offset] >= section[period]:
                raise ConfigError(f"{path}: {prefix}{offset}={section[offset]} is not below {prefix}{period}="
                                  f"{section[period]}: layer i has it when i % {period} == {offset}, so no layer "
                                  f"would; set {offset} between 0 and {section[period] - 1}")


# ---------------------------------------------------------------------------------------
# Pass 2: the resolved config


def _sections(config, prefix: str = "") -> Iterator[tuple[str, object]]:
    yield prefix, config
    for key, value in vars(config).items():
        if key != "quantization_config" and hasattr(value, "to_dict") and hasattr(value, "model_type"):
            yield from _sections(value, f"{prefix}{key}.")


def _first(section, names, written=()) -> tuple[str, int] | tuple[None, None]:
    # Aliases resolve to one value (Qwen3's num_experts is num_local_experts): name the one config.json wrote.
    for name in sorted(names, key=lambda n: n not in written):
        value = getattr(section, name, None)
        if _int(value):
            return name, value
    return None, None


def check_config(config, path, raw: dict | None = None) -> None:
    """Fields that must agree with each other, and a bounded parameter count, on a transformers config.

    `raw`: the config.json as written, so that messages use its names for aliased fields.
    """
    written = dict(_raw_sections(raw)) if raw is not None else {}
    total = 0
    largest = (0, "", None)
    for prefix, section in _sections(config):
        _check_section(section, prefix, path, set(written.get(prefix, ())))
        params = _estimated_params(section)
        total += params
        if params > largest[0]:
            largest = (params, prefix, section)
    if total > MAX_PARAMS:
        _, prefix, section = largest
        aliases = getattr(type(section), "attribute_map", {})   # e.g. num_experts -> num_local_experts: one field
        sizes = ", ".join(f"{prefix}{name}={getattr(section, name)}" for name in _SIZING
                          if name not in aliases and _int(getattr(section, name, None)))
        raise ConfigError(f"{path}: this config describes about {total:.3g} parameters ({sizes}), more than the "
                          f"{MAX_PARAMS:.0e} moe-offload plans (the largest published MoE models have about 1e12); "
                          "one of these fields is wrong: fix it in config.json")


def _check_section(section, prefix: str, path, written: set[str]) -> None:
    present = {n for n in TOPK_FIELDS if _int(getattr(section, n, None))}
    e_name, experts = _first(section, EXPERT_FIELDS, written)
    k_name, top_k = _first(section, _routing_topk_fields(present, e_name is not None), written)
    if experts is not None and top_k is not None and top_k > experts:
        raise ConfigError(f"{path}: {prefix}{k_name}={top_k} is more than {prefix}{e_name}={experts}: each token "
                          f"is routed to top-k distinct experts of its layer's {experts}; set {k_name} between 1 "
                          f"and {experts}")

    head_name, heads = _first(section, ("num_attention_heads", "num_heads"), written)
    kv = getattr(section, "num_key_value_heads", None)
    if heads is not None and _int(kv) and heads % kv:
        raise ConfigError(f"{path}: {prefix}{head_name}={heads} is not a multiple of "
                          f"{prefix}num_key_value_heads={kv}: grouped-query attention shares each KV head among a "
                          f"whole number of query heads; make num_key_value_heads a divisor of {head_name}")
    hidden = getattr(section, "hidden_size", None)
    if heads is not None and _int(hidden) and getattr(section, "head_dim", None) is None and hidden % heads:
        raise ConfigError(f"{path}: {prefix}hidden_size={hidden} is not a multiple of {prefix}{head_name}={heads}: "
                          "without head_dim, each head is hidden_size / heads wide; fix either, or give head_dim")
    keys, values = getattr(section, "linear_num_key_heads", None), getattr(section, "linear_num_value_heads", None)
    if _int(keys) and _int(values) and values % keys:
        raise ConfigError(f"{path}: {prefix}linear_num_value_heads={values} is not a multiple of "
                          f"{prefix}linear_num_key_heads={keys}: linear attention shares each key head among a "
                          "whole number of value heads; make linear_num_key_heads a divisor")

    model_type = getattr(section, "model_type", "")
    if experts is not None and top_k is not None:
        if model_type in _TOP2_GROUPED or getattr(section, "topk_method", None) == "group_limited_greedy":
            _check_groups(section, prefix, path, e_name, experts, k_name, top_k, model_type in _TOP2_GROUPED)
        if model_type == "phimoe" and (top_k != 2 or experts < 2):
            raise ConfigError(f"{path}: {prefix}{k_name}={top_k} with {prefix}{e_name}={experts}: PhiMoE's "
                              "sparsemixer router always picks exactly 2 experts; set num_experts_per_tok to 2 "
                              "and num_local_experts to at least 2")


def _check_groups(section, prefix, path, e_name, experts, k_name, top_k, top2: bool) -> None:
    groups, chosen = getattr(section, "n_group", None), getattr(section, "topk_group", None)
    if not (_int(groups) and _int(chosen)):
        return
    if experts % groups:
        raise ConfigError(f"{path}: {prefix}{e_name}={experts} is not a multiple of {prefix}n_group={groups}: the "
                          "router splits the experts into n_group equal groups; make n_group a divisor")
    per_group = experts // groups
    if top2 and per_group < 2:
        raise ConfigError(f"{path}: {prefix}{e_name}={experts} in {prefix}n_group={groups} groups leaves "
                          f"{per_group} expert per group: the router scores each group by its best 2 experts; "
                          "use fewer groups or more experts")
    if chosen > groups:
        raise ConfigError(f"{path}: {prefix}topk_group={chosen} is more than {prefix}n_group={groups}: the router "
                          f"keeps topk_group of the n_group groups; set topk_group between 1 and {groups}")
    if top_k > chosen * per_group:
        raise ConfigError(f"{path}: {prefix}{k_name}={top_k} is more than the {chosen * per_group} experts that "
                          f"topk_group={chosen} groups of {per_group} hold: the router picks the top-k inside the "
                          "kept groups; lower the top-k or raise topk_group")


def check_built(model, path) -> None:
    """The parameters transformers built (on the meta device: nothing allocated) are within MAX_PARAMS.

    The estimate of check_config covers the fields every family has; this counts exactly, whatever field
    (a shared-expert width, a Mamba expansion, a patch size) made the model too large.
    """
    count, largest = 0, None
    for name, p in model.named_parameters():
        count += p.numel()
        if largest is None or p.numel() > largest[1].numel():
            largest = (name, p)
    if count > MAX_PARAMS:
        name, p = largest
        raise ConfigError(f"{path}: this config builds {count:.3g} parameters, more than the {MAX_PARAMS:.0e} "
                          f"moe-offload plans (the largest published MoE models have about 1e12); the largest "
                          f"tensor, {name} {list(p.shape)}, shows which field of config.json is wrong: fix it")


# Fields named when the parameter count is out of bounds.
_SIZING = ("num_hidden_layers", "depth", "hidden_size", "vocab_size", "intermediate_size", "moe_intermediate_size",
           "num_attention_heads", "num_heads", "head_dim") + EXPERT_FIELDS


def _estimated_params(section) -> int:
    """An upper estimate of a (sub-)config's parameters: every layer with attention, a dense FFN and its experts.

    Only its order of magnitude matters: it refuses sizes no machine holds before any code loops over them.
    """
    def get(*names) -> int:
        return next((v for n in names if _int(v := getattr(section, n, None)) and v > 0), 0)

    layers, hidden = get("num_hidden_layers", "depth", "num_layers"), get("hidden_size")
    if not layers or not hidden:
        return 0
    heads = get("num_attention_heads", "num_heads") or 1
    kv = get("num_key_value_heads") or heads
    head_dim = get("head_dim") or max(1, hidden // heads)
    attention = hidden * head_dim * 2 * (heads + kv)
    dense = 3 * hidden * get("intermediate_size")
    experts = 3 * hidden * get("moe_intermediate_size", "intermediate_size") * get(*EXPERT_FIELDS)
    return layers * (attention + dense + experts) + 2 * get("vocab_size") * hidden
