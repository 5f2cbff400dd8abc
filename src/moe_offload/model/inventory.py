"""Inventory: every parameter and persistent buffer of a model, with its storage bytes.

No tensor data is read or allocated. Three sources:

- a Hugging Face `config.json` (or its folder): the model is built by transformers on the
  meta device; storage bytes follow the config's dtype and `quantization_config`;
- a checkpoint folder of safetensors files: the same meta model gives the in-memory names,
  the files' headers give the real dtypes and bytes (checkpoint names are mapped to
  in-memory names by `layouts`);
- a live `nn.Module`, meta or real.

Reading the config and building the meta model is config.py; the safetensors headers, checkpoint.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from .checkpoint import QUANT_SUFFIXES, ST_DTYPES, expected_slot_shape, read_headers, safetensors_files, slot_shape
from .config import (DTYPE_NAMES, assumed_dtype_note, build_meta_model, quant_rule, read_config, routing_of,
                     storage_dtype)
from .config_check import EXPERT_FIELDS, TOPK_FIELDS
from ..errors import CheckpointError, ConfigError

# Segments that hold numbered layers, and segments that mark a non-language tower.
LAYER_LISTS = {"layers", "layer", "h", "blocks", "block"}
_TOWERS = {
    "vision": {"visual", "vision_tower", "vision_model", "vision_encoder", "vision", "image_encoder",
               "multi_modal_projector", "mm_projector", "vision_projector"},
    "audio": {"audio_tower", "audio_model", "audio_encoder", "audio"},
}


@dataclass(frozen=True)
class TensorRecord:
    name: str                 # in-memory name, as named_parameters()/named_buffers() give it
    shape: tuple[int, ...]
    dtype: str                # storage dtype: "bfloat16", "float8_e4m3fn", "mxfp4", ...
    bytes: int                # storage bytes, block scales included
    layer: int | None
    component: str            # "language", "vision", "audio"
    module_class: str = ""    # class of the owning module
    is_buffer: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Inventory:
    records: tuple[TensorRecord, ...]
    model_type: str
    num_experts: int | None
    top_k: int | None
    tied: tuple[tuple[str, str], ...] = ()   # (alias, tensor) pairs, e.g. ("lm_head.weight", "model.embed_tokens.weight")
    source: str = "config"                   # "config", "checkpoint" or "module"
    notes: tuple[str, ...] = field(default=())

    def by_name(self) -> dict[str, TensorRecord]:
        return {r.name: r for r in self.records}


def layer_prefix(name: str) -> str | None:
    """`model.layers.3` for `model.layers.3.self_attn.q_proj.weight`; None outside numbered layers."""
    parts = name.split(".")
    for i, (prev, seg) in enumerate(zip(parts, parts[1:])):
        if prev in LAYER_LISTS and seg.isdigit():
            return ".".join(parts[:i + 2])
    return None


def layer_of(name: str) -> int | None:
    prefix = layer_prefix(name)
    return int(prefix.rpartition(".")[2]) if prefix is not None else None


def component_of(name: str) -> str:
    segments = set(name.split("."))
    for component, markers in _TOWERS.items():
        if segments & markers:
            return component
    return "language"


# ---------------------------------------------------------------------------------------
# Records from a module


def records_from_module(module: nn.Module, *, config=None, storage_dtype: torch.dtype | None = None) -> list[TensorRecord]:
    """One record per parameter and persistent buffer, in declaration order."""
    quant = quant_rule(config) if config is not None else None
    records = []
    seen: set[int] = set()
    for mod_name, mod in module.named_modules():
        cls = type(mod).__name__
        entries = [(n, p, False) for n, p in mod._parameters.items() if p is not None]
        entries += [(n, b, True) for n, b in mod._buffers.items()
                    if b is not None and n not in mod._non_persistent_buffers_set]
        for local, tensor, is_buffer in entries:
            if id(tensor) in seen:  # tied: named_parameters() lists it once, under its first name
                continue
            seen.add(id(tensor))
            name = f"{mod_name}.{local}" if mod_name else local
            shape = tuple(tensor.shape)
            dtype = storage_dtype if (storage_dtype is not None and tensor.is_floating_point()) else tensor.dtype
            dtype_name, nbytes = str(dtype).removeprefix("torch."), math.prod(shape) * dtype.itemsize
            is_linear_weight = local == "weight" and isinstance(mod, nn.Linear)
            is_expert_weight = len(shape) == 3 and "Experts" in cls and not local.endswith("bias")
            if quant is not None and not is_buffer:
                quantized = quant(name, cls, shape, is_linear_weight or is_expert_weight)
                if quantized is not None:
                    dtype_name, nbytes = quantized
            records.append(TensorRecord(name, shape, dtype_name, nbytes, layer_of(name), component_of(name),
                                        cls, is_buffer))
    return records


def _tied_pairs(module: nn.Module) -> tuple[tuple[str, str], ...]:
    first: dict[int, str] = {}
    pairs = []
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            pairs.append((name, first[id(p)]))
        else:
            first[id(p)] = name
    return tuple(pairs)


def from_module(module: nn.Module, *, dtype: str | None = None) -> Inventory:
    config = getattr(module, "config", None)
    experts, top_k = routing_of(config) if config is not None else (None, None)
    if experts is None:  # a bare module: look for the routing on its submodules
        for sub in module.modules():
            e = next((getattr(sub, f) for f in EXPERT_FIELDS if isinstance(getattr(sub, f, None), int)), None)
            k = next((getattr(sub, f) for f in TOPK_FIELDS if isinstance(getattr(sub, f, None), int)), None)
            if e and k:
                experts, top_k = e, k
                break
    storage = getattr(torch, DTYPE_NAMES[dtype]) if dtype else None
    records = records_from_module(module, config=config, storage_dtype=storage)
    return Inventory(tuple(records), getattr(config, "model_type", type(module).__name__), experts, top_k,
                     _tied_pairs(module), "module")


def from_config(source, *, dtype: str | None = None) -> Inventory:
    config = read_config(source)
    storage = storage_dtype(config, dtype)
    assumed = assumed_dtype_note(config, dtype)  # before building: transformers then records the dtype on config
    model = build_meta_model(config, storage)
    # Built in the storage dtype already; not forcing it keeps what transformers holds in float32 whatever the
    # dtype (`_keep_in_fp32_modules_strict`: DeepSeek-V3/GLM-4.5 routers and `e_score_correction_bias`).
    records = records_from_module(model, config=config)
    experts, top_k = routing_of(config)
    notes = tuple(n for n in (getattr(config, "_moe_offload_note", None), assumed) if n)
    return Inventory(tuple(records), config.model_type, experts, top_k, _tied_pairs(model), "config", notes)


# ---------------------------------------------------------------------------------------
# Records from checkpoint headers


def from_checkpoint(folder, *, dtype: str | None = None, model: nn.Module | None = None,
                    config=None) -> Inventory:
    """Inventory from the safetensors headers. `dtype` (bf16/fp16/fp32): floating tensors are counted in
    that dtype, as the loader will hold them. `model`/`config`: the skeleton the caller already built."""
    folder = Path(folder)
    config = config if config is not None else read_config(folder)
    files = safetensors_files(folder)
    if not files:
        raise CheckpointError(f"{folder} holds no .safetensors files; plan from its config.json instead")
    if model is None:
        model = build_meta_model(config, storage_dtype(config, dtype))
    base = from_module(model)
    headers = read_headers(files)
    from ..formats.layouts import map_keys
    from ..formats.quant import check_headers, spec_from_config

    spec = spec_from_config(config)
    if spec is not None:  # a scale that does not fit its weight is refused here, before any plan is made
        check_headers(spec, headers)

    known = {r.name for r in base.records}
    # Quantized storage: `x_blocks` carries the values of `x`, `x_scales`/`weight_scale_inv` its scales.
    owner = {}
    for key in headers:
        stripped = key
        for suffix in QUANT_SUFFIXES:
            if key.endswith(suffix):
                stripped = key[: -len(suffix)] + (".weight" if suffix.startswith(".weight") else "")
                break
        owner[key] = stripped
    slots = map_keys(model, sorted(set(owner.values())), known=known)
    by_name = base.by_name()
    aliases = dict(base.tied)  # a tied checkpoint may still store `lm_head.weight`; transformers drops the copy
    nbytes: dict[str, int] = {}
    dtypes: dict[str, str] = {}
    covered: dict[str, set] = {}   # target -> {(expert, part)} of the checkpoint tensors holding its values
    unexpected, misshapen = [], []
    for key, (_, st_dtype, shape) in headers.items():
        slot = slots[owner[key]]
        target = slot.target
        if target in aliases:
            continue
        if target not in known:
            unexpected.append(key)
            continue
        name, size = ST_DTYPES.get(st_dtype, (st_dtype.lower(), 1))
        nbytes[target] = nbytes.get(target, 0) + math.prod(shape) * size
        if key.endswith("_blocks"):
            dtypes[target] = "mxfp4"
        elif owner[key] == key:
            dtypes[target] = name
        if owner[key] == key or key.endswith("_blocks"):
            covered.setdefault(target, set()).add((slot.expert, slot.part, slot.parts))
        expected = expected_slot_shape(slot, by_name[target].shape)
        if owner[key] == key and slot_shape(slot, shape, expected) != expected:
            misshapen.append(f"{key} {list(shape)} (needs {list(expected)})")
    if unexpected:
        raise CheckpointError(
            f"{folder}: {len(unexpected)} checkpoint tensor(s) match no tensor of {type(model).__name__} "
            f"(first: {unexpected[:3]}); the checkpoint and config.json are for different models")
    if misshapen:
        raise CheckpointError(
            f"{folder}: {len(misshapen)} checkpoint tensor(s) have the wrong shape for {type(model).__name__} "
            f"(first: {misshapen[:3]}); the checkpoint and config.json are for different models")
    missing = [r.name for r in base.records if r.name not in nbytes and not r.is_buffer]
    # A fused tensor (E experts x parts) needs every one of its per-expert checkpoint tensors.
    for target, cov in covered.items():
        per_expert = any(expert is not None for expert, _, _ in cov)
        need = (by_name[target].shape[0] if per_expert else 1) * max(parts for _, _, parts in cov)
        if len(cov) < need:
            missing.append(f"{target} ({len(cov)} of its {need} per-expert/part tensors)")
    if missing:
        raise CheckpointError(
            f"{folder}: {len(missing)} tensor(s) of the model are in no checkpoint file (first: {missing[:3]}); "
            "the checkpoint is incomplete or for another config")
    override = getattr(torch, DTYPE_NAMES[dtype]) if dtype else None
    records = []
    for r in base.records:
        if r.name in nbytes:
            stored = dtypes.get(r.name, r.dtype)
            if override is not None and getattr(torch, stored, None) in _FLOATS:
                r = TensorRecord(r.name, r.shape, str(override).removeprefix("torch."), r.numel * override.itemsize,
                                 r.layer, r.component, r.module_class, r.is_buffer)
            else:
                r = TensorRecord(r.name, r.shape, stored, nbytes[r.name], r.layer, r.component, r.module_class,
                                 r.is_buffer)
        records.append(r)
    note = getattr(config, "_moe_offload_note", None)
    return Inventory(tuple(records), config.model_type, base.num_experts, base.top_k, base.tied, "checkpoint",
                     (note,) if note else ())


_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def inventory(source, *, dtype: str | None = None) -> Inventory:
    """Inventory of a model folder (checkpoint headers when it has weights), a config.json, or an nn.Module."""
    if isinstance(source, nn.Module):
        return from_module(source, dtype=dtype)
    path = Path(source)
    if not path.exists():
        raise ConfigError(f"{path} does not exist: give a model folder or a config.json path")
    if path.is_dir() and safetensors_files(path):
        return from_checkpoint(path, dtype=dtype)
    return from_config(path, dtype=dtype)
