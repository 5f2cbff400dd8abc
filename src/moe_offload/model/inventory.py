"""Inventory: every parameter and persistent buffer of a model, with its storage bytes.

No tensor data is read or allocated. Three sources:

- a Hugging Face `config.json` (or its folder): the model is built by transformers on the
  meta device; storage bytes follow the config's dtype and `quantization_config`;
- a checkpoint folder of safetensors files: the same meta model gives the in-memory names,
  the files' headers give the real dtypes and bytes (checkpoint names are mapped to
  in-memory names by `layouts`);
- a live `nn.Module`, meta or real.
"""

from __future__ import annotations

import fnmatch
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from .config_check import EXPERT_FIELDS, TOPK_FIELDS, check_built, check_config, check_raw
from ..errors import CheckpointError, ConfigError

# Segments that hold numbered layers, and segments that mark a non-language tower.
LAYER_LISTS = {"layers", "layer", "h", "blocks", "block"}
_TOWERS = {
    "vision": {"visual", "vision_tower", "vision_model", "vision_encoder", "vision", "image_encoder",
               "multi_modal_projector", "mm_projector", "vision_projector"},
    "audio": {"audio_tower", "audio_model", "audio_encoder", "audio"},
}
# Config fields that name the routed-expert count and top-k, across families (config_check owns the list).
_EXPERT_FIELDS = EXPERT_FIELDS
_TOPK_FIELDS = TOPK_FIELDS
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32",
               "bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}
# Bytes per element of the dtypes a safetensors header can name.
_ST_DTYPES = {"F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
              "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1), "I64": ("int64", 8),
              "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1), "BOOL": ("bool", 1)}
# Checkpoint suffixes of quantized storage that belong to another tensor.
_QUANT_SUFFIXES = ("_blocks", "_scales", ".weight_scale_inv", "_scale_inv", ".weight_scale")


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


def _text_config(config):
    for attr in ("text_config", "language_config", "llm_config"):
        sub = getattr(config, attr, None)
        if sub is not None:
            return sub
    return config


def routing_of(config) -> tuple[int | None, int | None]:
    """(routed experts per layer, top-k) from a config, or (None, None) for a dense model."""
    text = _text_config(config)
    experts = next((getattr(text, f) for f in _EXPERT_FIELDS if isinstance(getattr(text, f, None), int)), None)
    top_k = next((getattr(text, f) for f in _TOPK_FIELDS if isinstance(getattr(text, f, None), int)), None)
    if not experts or not top_k:
        return None, None
    return experts, top_k


# ---------------------------------------------------------------------------------------
# Building the meta model


def read_config(source) -> "object":
    """A transformers config from a folder or a config.json path. Never touches a hub.

    The fields that size the model are checked before transformers sees them, and again once it has
    filled in its defaults (config_check): a malformed config is a ConfigError before anything is built.
    """
    path = Path(source)
    cfg_path = path / "config.json" if path.is_dir() else path
    if not cfg_path.is_file():
        raise ConfigError(f"no config.json at {cfg_path}: give a model folder holding config.json, or the file's path")
    try:
        raw = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{cfg_path} is not valid JSON ({exc}); fix or re-download the file") from exc
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ConfigError(f"{cfg_path} has no 'model_type'; it is not a Hugging Face model config")
    check_raw(raw, cfg_path)
    from transformers import AutoConfig, CONFIG_MAPPING

    model_type = raw["model_type"]
    try:
        if model_type in CONFIG_MAPPING:
            config = AutoConfig.from_pretrained(str(cfg_path.parent), local_files_only=True)
        else:
            # Configs such as Kimi-K2's name a custom model_type but an architecture transformers has.
            config = _config_from_architecture(raw, cfg_path)
    except ConfigError:
        raise
    except Exception as exc:  # transformers raises many types for malformed configs
        raise ConfigError(f"{cfg_path}: transformers cannot read this config ({type(exc).__name__}: {exc})") from exc
    check_config(config, cfg_path, raw)
    return config


def _config_from_architecture(raw: dict, cfg_path: Path):
    import transformers

    for arch in raw.get("architectures") or []:
        cls = getattr(transformers, arch, None)
        if cls is not None and getattr(cls, "config_class", None) is not None:
            fields = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map", "architectures")}
            config = cls.config_class(**fields)
            config.architectures = [arch]
            config.name_or_path = str(cfg_path.parent)  # what from_pretrained records: errors name the folder
            config._moe_offload_note = (
                f"model_type {raw['model_type']!r} is not a transformers family; built as {arch} "
                "(the architecture its config names), without the checkpoint's custom code"
            )
            return config
    raise ConfigError(
        f"{cfg_path}: unknown model_type {raw['model_type']!r} and no architecture transformers knows "
        f"(architectures={raw.get('architectures')}); moe-offload runs families transformers implements"
    )


def _config_dtype(config) -> torch.dtype | None:
    for cfg in (config, _text_config(config)):
        value = getattr(cfg, "dtype", None)  # transformers 5 maps the deprecated torch_dtype here
        if isinstance(value, torch.dtype):
            return value
        if isinstance(value, str) and hasattr(torch, value):
            return getattr(torch, value)
    return None


def _quantization_method(config) -> str | None:
    qc = getattr(config, "quantization_config", None) or getattr(_text_config(config), "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    return str(qc.get("quant_method", "quantized"))


def _storage_dtype(config, dtype: str | None) -> torch.dtype:
    if dtype is not None:
        if dtype not in DTYPE_NAMES:
            raise ConfigError(f"unknown dtype {dtype!r}: use bf16, fp16 or fp32")
        return getattr(torch, DTYPE_NAMES[dtype])
    found = _config_dtype(config)
    if found is not None:
        return found
    # Quantized releases (gpt-oss MXFP4, DeepSeek/Qwen FP8 blocks) store every tensor they do not quantize in
    # bf16; their config.json may name no dtype (the note of _assumed_dtype_note says so in the plan).
    return torch.bfloat16 if _quantization_method(config) is not None else torch.float32


def _assumed_dtype_note(config, dtype: str | None) -> str | None:
    method = _quantization_method(config)
    if dtype is not None or method is None or _config_dtype(config) is not None:
        return None
    return (f"config.json names no dtype (torch_dtype/dtype); its quantization_config ({method}) marks a quantized "
            "release, which stores its unquantized tensors in bfloat16: planned them as bfloat16 (--dtype / "
            "dtype= plans another)")


def build_meta_model(config, dtype: torch.dtype | None = None, *, device: str = "meta") -> nn.Module:
    """The model as transformers builds it, on the meta device (no memory for weights).

    `device="cpu"` builds under the caller's own context instead (the loader puts only the
    parameters on meta and keeps real buffers).
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    dtype = dtype or _storage_dtype(config, None)
    classes = (AutoModelForImageTextToText, AutoModelForCausalLM) if hasattr(config, "vision_config") else (
        AutoModelForCausalLM, AutoModelForImageTextToText)
    errors = []
    with torch.device(device):
        for auto in classes:
            try:
                model = auto.from_config(config, dtype=dtype)
            except ValueError as exc:
                if "Unrecognized configuration class" not in str(exc):
                    raise _build_error(config, exc) from exc
                errors.append(str(exc).splitlines()[0])  # no model of this auto class: try the next one
            except Exception as exc:  # a config the checks let through that the model class still refuses
                raise _build_error(config, exc) from exc
            else:
                check_built(model, _source(config))
                return model
    raise ConfigError(f"transformers has no causal-LM or image-text-to-text model for {config.model_type!r}: {errors[0]}")


def _source(config) -> str:
    """The model folder a config was read from (read_config records it), for error messages."""
    return getattr(config, "name_or_path", "") or f"the {config.model_type} config"


def _build_error(config, exc: Exception) -> ConfigError:
    first = " ".join(str(exc).split())[:300]
    return ConfigError(f"{_source(config)}: transformers cannot build a {config.model_type} model from this config "
                       f"({type(exc).__name__}: {first}); a field that sizes the model is wrong: fix config.json")


# ---------------------------------------------------------------------------------------
# Records from a module


def _quant_rule(config):
    """A function (name, module_class, numel, shape, dtype) -> (dtype name, bytes) for the config's quantization."""
    from ..formats.quant import QuantFormat, spec_from_config

    # The loader's own reading of quantization_config: a method or block size it cannot size is an error here
    # too, not a plan at another precision (or a division by a zero block).
    spec = spec_from_config(config)
    if spec is None:
        return None
    # Without a list, transformers keeps the output embedding unquantized (quantizers.base.get_keys_to_not_convert):
    # DeepSeek-V3's fp8 checkpoint stores lm_head in bf16. A given list replaces that default.
    skip = spec.modules_to_not_convert if spec.modules_to_not_convert is not None else ("lm_head",)

    def skipped(name):
        # Entries are module names or fragments (`lm_head`, `mlp.gate`) or patterns (`model.layers.*.self_attn`).
        return any(s and (name == s or name.startswith(s + ".") or f".{s}." in f".{name}."
                          or fnmatch.fnmatchcase(name, s + ".*")) for s in skip)

    if spec.format is QuantFormat.FP8:
        bm, bn = spec.block

        def fp8(name, module_class, shape, is_weight):
            if not is_weight or len(shape) < 2 or skipped(name):
                return None
            rows, cols = shape[-2], shape[-1]
            lead = math.prod(shape[:-2])
            # A fused gate_up_proj [E, 2I, H] is two [I, H] checkpoint matrices, each with its own block grid.
            halves = 2 if name.endswith("gate_up_proj") else 1
            scales = lead * halves * math.ceil(rows // halves / bm) * math.ceil(cols / bn)
            return "float8_e4m3fn", math.prod(shape) + 4 * scales
        return fp8
    if spec.format is QuantFormat.MXFP4:
        def mxfp4(name, module_class, shape, is_weight):
            # GPT-OSS: routed expert matrices are MXFP4 (4-bit values + one 8-bit scale per 32): 4.25 bits each.
            if not is_weight or len(shape) != 3 or "Experts" not in module_class or skipped(name):
                return None
            return "mxfp4", math.prod(shape) * 17 // 32
        return mxfp4
    return None


def records_from_module(module: nn.Module, *, config=None, storage_dtype: torch.dtype | None = None) -> list[TensorRecord]:
    """One record per parameter and persistent buffer, in declaration order."""
    quant = _quant_rule(config) if config is not None else None
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
            e = next((getattr(sub, f) for f in _EXPERT_FIELDS if isinstance(getattr(sub, f, None), int)), None)
            k = next((getattr(sub, f) for f in _TOPK_FIELDS if isinstance(getattr(sub, f, None), int)), None)
            if e and k:
                experts, top_k = e, k
                break
    storage = getattr(torch, DTYPE_NAMES[dtype]) if dtype else None
    records = records_from_module(module, config=config, storage_dtype=storage)
    return Inventory(tuple(records), getattr(config, "model_type", type(module).__name__), experts, top_k,
                     _tied_pairs(module), "module")


def from_config(source, *, dtype: str | None = None) -> Inventory:
    config = read_config(source)
    storage = _storage_dtype(config, dtype)
    assumed = _assumed_dtype_note(config, dtype)  # before building: transformers then records the dtype on config
    model = build_meta_model(config, storage)
    # Built in the storage dtype already; not forcing it keeps what transformers holds in float32 whatever the
    # dtype (`_keep_in_fp32_modules_strict`: DeepSeek-V3/GLM-4.5 routers and `e_score_correction_bias`).
    records = records_from_module(model, config=config)
    experts, top_k = routing_of(config)
    notes = tuple(n for n in (getattr(config, "_moe_offload_note", None), assumed) if n)
    return Inventory(tuple(records), config.model_type, experts, top_k, _tied_pairs(model), "config", notes)


# ---------------------------------------------------------------------------------------
# Records from checkpoint headers


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's shard files; a missing shard named by the index is an error."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} is malformed ({exc}); it must hold a 'weight_map' object") from exc
        files = sorted({folder / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(
                f"{folder}: shard(s) {', '.join(missing)} named by {index.name} are missing; "
                "the checkpoint is incomplete, copy the missing files")
        return files
    return sorted(folder.glob("*.safetensors"))


def read_headers(files) -> dict[str, tuple[Path, str, tuple[int, ...]]]:
    """key -> (file, safetensors dtype, shape), from the headers alone."""
    from safetensors import safe_open

    out = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    out[key] = (path, sl.get_dtype(), tuple(sl.get_shape()))
        except Exception as exc:  # safetensors raises SafetensorError for bad headers and truncation
            raise CheckpointError(f"{path}: not a readable safetensors file ({exc}); the file is corrupt or "
                                  "truncated, copy it again") from exc
    return out


def _slot_shape(slot, shape: tuple[int, ...], expected: tuple[int, ...]) -> tuple[int, ...]:
    """A checkpoint tensor's shape once its slot's transpose is applied."""
    shape = list(shape)
    if slot.transpose is not None and not (slot.transpose_if_needed and tuple(shape) == expected):
        i, j = slot.transpose
        shape[i], shape[j] = shape[j], shape[i]
    return tuple(shape)


def _expected_slot_shape(slot, full: tuple[int, ...]) -> tuple[int, ...]:
    """The shape a checkpoint tensor must have to fill its slot of an in-memory tensor of shape `full`."""
    shape = list(full[1:] if slot.expert is not None else full)
    if slot.parts > 1 and 0 <= slot.part_dim < len(shape):
        shape[slot.part_dim] //= slot.parts
    return tuple(shape)


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
        model = build_meta_model(config, _storage_dtype(config, dtype))
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
        for suffix in _QUANT_SUFFIXES:
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
        name, size = _ST_DTYPES.get(st_dtype, (st_dtype.lower(), 1))
        nbytes[target] = nbytes.get(target, 0) + math.prod(shape) * size
        if key.endswith("_blocks"):
            dtypes[target] = "mxfp4"
        elif owner[key] == key:
            dtypes[target] = name
        if owner[key] == key or key.endswith("_blocks"):
            covered.setdefault(target, set()).add((slot.expert, slot.part, slot.parts))
        expected = _expected_slot_shape(slot, by_name[target].shape)
        if owner[key] == key and _slot_shape(slot, shape, expected) != expected:
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
