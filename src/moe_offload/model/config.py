"""A model's config as moe-offload reads it, and the meta model transformers builds from it.

`read_config` reads a folder's config.json (never a hub), checked before and after transformers sees it
(config_check.py), also for a custom model_type whose architecture transformers has. From a config: the
routed experts and top-k (`routing_of`), the dtype tensors are stored in (`storage_dtype`, with the note a
quantized release without a dtype gets), the bytes its quantization_config gives each tensor (`quant_rule`),
and the model itself on the meta device (`build_meta_model`; what transformers refuses is a ConfigError
naming the folder).
"""

from __future__ import annotations

import fnmatch
import json
import math
from pathlib import Path

import torch
import torch.nn as nn

from .config_check import EXPERT_FIELDS, TOPK_FIELDS, check_built, check_config, check_raw
from ..errors import ConfigError

DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32",
               "bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


def _text_config(config):
    for attr in ("text_config", "language_config", "llm_config"):
        sub = getattr(config, attr, None)
        if sub is not None:
            return sub
    return config


def routing_of(config) -> tuple[int | None, int | None]:
    """(routed experts per layer, top-k) from a config, or (None, None) for a dense model."""
    text = _text_config(config)
    experts = next((getattr(text, f) for f in EXPERT_FIELDS if isinstance(getattr(text, f, None), int)), None)
    top_k = next((getattr(text, f) for f in TOPK_FIELDS if isinstance(getattr(text, f, None), int)), None)
    if not experts or not top_k:
        return None, None
    return experts, top_k


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


def storage_dtype(config, dtype: str | None) -> torch.dtype:
    if dtype is not None:
        if dtype not in DTYPE_NAMES:
            raise ConfigError(f"unknown dtype {dtype!r}: use bf16, fp16 or fp32")
        return getattr(torch, DTYPE_NAMES[dtype])
    found = _config_dtype(config)
    if found is not None:
        return found
    # Quantized releases (gpt-oss MXFP4, DeepSeek/Qwen FP8 blocks) store every tensor they do not quantize in
    # bf16; their config.json may name no dtype (the note of assumed_dtype_note says so in the plan).
    return torch.bfloat16 if _quantization_method(config) is not None else torch.float32


def assumed_dtype_note(config, dtype: str | None) -> str | None:
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

    dtype = dtype or storage_dtype(config, None)
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


def quant_rule(config):
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
