"""The released configs make-tiny --like reads, and the edit that makes one the config.json it writes.

`read_released(like)` reads a released config.json (a path, a folder holding one and maybe its
generation_config.json, a name bundled in ``tiny/like/``: qwen3-30b-a3b, gpt-oss-20b, deepseek-v2-lite,
mixtral-8x7b, or a dict); `family_of` is its model_type. An `Edit` changes a copy of it and notes every change;
`apply_sizes` writes the sizes given explicitly into the family's own field names (families.FIELDS) and what the
layer count implies: per-layer lists (`layer_types`) cut to the first N layers, layer-index lists
(`mlp_only_layers`) kept below N, `max_window_layers` at most N, `first_k_dense_replace` below N so that at least
one layer is MoE. make_like.py does the rest (dtype, quantization, pad token, writing).
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .families import EXACT_TOP_K, FAMILIES, KV_HEADS_ARE_HEADS, MIN_EXPERTS, Size, size_fields
from .heads import invalid
from .make import canonical_dtype

__all__ = ["BUNDLED", "bundled_names", "Released", "read_released", "family_of", "Edit", "size_of", "apply_sizes",
           "check_sizes", "released_dtype"]

BUNDLED = Path(__file__).resolve().parent / "like"
# Per-layer lists (one entry per decoder layer: cut to the first N) and lists of layer indices (kept below N).
_PER_LAYER = ("layer_types", "no_rope_layers")
_LAYER_INDICES = ("mlp_only_layers", "moe_layers")
# Fields that repeat another under an older name in released configs (gpt-oss's experts_per_token).
_ALIASES = {"num_experts_per_tok": ("experts_per_token",)}


def bundled_names() -> list[str]:
    """The released configs shipped with the package, by name (`--like qwen3-30b-a3b`)."""
    return sorted(p.stem for p in BUNDLED.glob("*.json"))


@dataclass(frozen=True)
class Released:
    """A released model's config.json (and generation_config.json, when its folder had one)."""

    source: str                       # the bundled name or the path given, for messages and the record
    config: dict[str, Any]
    generation: dict[str, Any] | None = None


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise invalid(f"cannot read {what} {path}", exc.strerror or str(exc),
                      "give a readable config.json, a folder holding one, or a bundled name "
                      f"({', '.join(bundled_names())})") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise invalid(f"{what} {path} is not valid JSON", f"{exc.msg} at line {exc.lineno} column {exc.colno}",
                      "give the config.json exactly as released") from exc
    if not isinstance(data, dict):
        raise invalid(f"{what} {path} is not a JSON object", f"it holds a {type(data).__name__}",
                      "give a model's config.json")
    return data


def read_released(like: str | os.PathLike[str] | Mapping[str, Any]) -> Released:
    """The released config `like` names: a dict, a config.json path, a folder holding config.json (and maybe
    generation_config.json), or a bundled name (`bundled_names()`, with or without `.json`). ValueError (what,
    why, fix) for a missing file, malformed JSON or a config without a model_type."""
    if isinstance(like, Mapping):
        released = Released("<dict>", copy.deepcopy(dict(like)))
    else:
        path = Path(like).expanduser()
        name = str(like).lower().removesuffix(".json")
        if not path.exists() and os.sep not in str(like) and name in bundled_names():
            released = Released(name, _read_json(BUNDLED / f"{name}.json", "bundled config"))
        elif path.is_dir():
            config = path / "config.json"
            if not config.is_file():
                raise invalid(f"{path} holds no config.json", "--like reads a released model's config.json",
                              "give the config.json itself, or the folder it is in")
            gen = path / "generation_config.json"
            released = Released(str(path), _read_json(config, "config"),
                                _read_json(gen, "generation config") if gen.is_file() else None)
        elif path.is_file():
            released = Released(str(path), _read_json(path, "config"))
        else:
            raise invalid(f"--like {like}: no such file", "it is neither a config.json, a folder holding one, nor a "
                          f"bundled name", f"give a path, or one of {', '.join(bundled_names())}")
    model_type = released.config.get("model_type")
    if not isinstance(model_type, str):
        raise invalid(f"{released.source} has no model_type", "make-tiny takes the family from config.json's "
                      "model_type", "give a transformers config.json (it names its model_type)")
    return released


def family_of(released: Released, family: str | None = None) -> str:
    """make-tiny's family for `released` (its model_type); `family`, when given, must agree."""
    model_type = released.config["model_type"]
    if model_type not in FAMILIES:
        raise invalid(f"model_type {model_type!r} of {released.source} is not one make-tiny can write",
                      f"it writes {', '.join(FAMILIES)}", "give the config of a model of one of these families")
    if family is not None and family != model_type:
        raise invalid(f"--family {family} disagrees with {released.source}, whose model_type is {model_type}",
                      "--like takes the family from the config", "leave --family out")
    return model_type


@dataclass
class Edit:
    """The released config being made into the written one, with every change noted."""

    config: dict[str, Any]
    text_path: str                       # "" or "text_config." (where the text model's fields are)
    changed: dict[str, list[Any]] = field(default_factory=dict)
    removed: list[str] = field(default_factory=list)

    @property
    def text(self) -> dict[str, Any]:
        return self.config["text_config"] if self.text_path else self.config

    def set(self, key: str, value: Any, *, top: bool = False) -> None:
        where = self.config if top else self.text
        name = key if top else self.text_path + key
        old = where.get(key, None)
        if key in where and old == value:
            return
        first = self.changed.get(name, [old])[0]
        where[key] = value
        if first == value:
            self.changed.pop(name, None)
        else:
            self.changed[name] = [first, value]

    def remove(self, key: str, *, top: bool = True) -> None:
        where = self.config if top else self.text
        if key in where:
            del where[key]
            self.removed.append(key if top else self.text_path + key)


def size_of(text: dict[str, Any], family: str, size: Size) -> Any:
    fields = size_fields(family, size)
    return text.get(fields[0]) if fields else None


def apply_sizes(edit: Edit, family: str, *, layers, experts, top_k, hidden, heads, kv_heads, head_dim,
                 expert_ffn, dense_ffn, vocab_size) -> None:
    """Write the explicitly given sizes into the family's own fields, then what the layer count implies."""
    text = edit.text
    for key, value in (("hidden_size", hidden), ("num_attention_heads", heads), ("num_key_value_heads", kv_heads),
                       ("vocab_size", vocab_size)):
        if value is not None:
            edit.set(key, value)
    if heads is not None and family in KV_HEADS_ARE_HEADS:
        edit.set("num_key_value_heads", heads)
    for size, value in ((Size.EXPERTS, experts), (Size.TOP_K, top_k), (Size.EXPERT_FFN, expert_ffn),
                        (Size.DENSE_FFN, dense_ffn)):
        if value is None:
            continue
        fields = size_fields(family, size)
        if not fields:   # only DENSE_FFN can be missing (every family has experts, top_k and an expert width)
            raise invalid(f"--dense-ffn {value} is invalid for {family}", f"{family} has no dense MLP or shared "
                          "expert: its intermediate_size is each expert's width", "leave it out, or give --expert-ffn")
        for key in fields:
            edit.set(key, value)
            for alias in _ALIASES.get(key, ()):
                if alias in text:
                    edit.set(alias, value)
    if head_dim is not None:
        if family in ("deepseek_v2", "deepseek_v3"):   # MLA: make-tiny's own rule (families._deepseek_mla)
            for key, value in (("qk_nope_head_dim", head_dim), ("qk_rope_head_dim", head_dim // 2),
                               ("v_head_dim", head_dim)):
                edit.set(key, value)
        elif "head_dim" in size_fields(family, Size.HEAD_DIM):
            edit.set("head_dim", head_dim)
        else:
            raise invalid(f"--head-dim {head_dim} is invalid for {family}", f"{family}'s config has no head_dim: each "
                          "head is hidden / heads wide", "give --hidden or --heads instead")
    if layers is not None:
        _apply_layers(edit, layers)


def _apply_layers(edit: Edit, layers: int) -> None:
    text = edit.text
    released = text.get("num_hidden_layers")
    edit.set("num_hidden_layers", layers)
    for key in _PER_LAYER:
        if isinstance(text.get(key), list) and len(text[key]) > layers:
            edit.set(key, text[key][:layers])
    for key in _LAYER_INDICES:
        if isinstance(text.get(key), list):
            edit.set(key, [i for i in text[key] if isinstance(i, int) and i < layers])
    if isinstance(text.get("max_window_layers"), int) and text["max_window_layers"] > layers:
        edit.set("max_window_layers", layers)
    dense = text.get("first_k_dense_replace")
    if isinstance(dense, int) and dense >= layers:
        edit.set("first_k_dense_replace", layers - 1)   # keep an MoE layer: the point of an MoE checkpoint
    # Any other per-layer list of the released length (a field this table does not know yet) is cut too.
    for key, value in list(text.items()):
        if ("layer" in key and key not in _PER_LAYER and key not in _LAYER_INDICES and isinstance(value, list)
                and isinstance(released, int) and len(value) == released > layers):
            edit.set(key, value[:layers])


def check_sizes(text: dict[str, Any], family: str, source: str) -> None:
    experts, top_k = size_of(text, family, Size.EXPERTS), size_of(text, family, Size.TOP_K)
    if isinstance(experts, int) and isinstance(top_k, int):
        if not 1 <= top_k <= experts:
            raise invalid(f"top_k={top_k} is invalid for experts={experts}", "each token is routed to top_k "
                          "distinct experts, so 1 <= top_k <= experts", f"give a --top-k between 1 and {experts}")
        if experts < MIN_EXPERTS.get(family, 1):
            raise invalid(f"experts={experts} is too few for {family}", "its group-limited router ranks each "
                          f"expert group by its best {MIN_EXPERTS[family]} experts",
                          f"give --experts {MIN_EXPERTS[family]} or more")
        if family in EXACT_TOP_K and top_k != EXACT_TOP_K[family]:
            raise invalid(f"top_k={top_k} is not supported for {family}", "its router always selects exactly "
                          f"{EXACT_TOP_K[family]} experts", f"give --top-k {EXACT_TOP_K[family]}")


def released_dtype(config: dict[str, Any]) -> str | None:
    for key in ("dtype", "torch_dtype"):
        value = config.get(key) or (config.get("text_config") or {}).get(key)
        if isinstance(value, str):
            try:
                return canonical_dtype(value)
            except ValueError:
                return None   # a dtype make-tiny does not write (float8...): its default then
    return None
