"""make-tiny --like: a random-weight checkpoint with every dimension and field of a released model's config.json.

`make_like(out_dir, like, layers=4)` reads a released config.json (like_config.read_released: a path, a folder
holding one, a name bundled in ``tiny/like/``: qwen3-30b-a3b, gpt-oss-20b, deepseek-v2-lite, mixtral-8x7b, or a
dict) and writes the folder make-tiny writes (write.write_model: streamed weights, tokenizer,
moe_offload_tiny.json), of that model's family (its model_type) and shapes. A user sees a released model's real per-layer sizes and speed without its weights.

What the written config.json holds: every field of the released one, as released (legacy names such as
`torch_dtype` and `rope_scaling` included), except what must change, and the `like` entry of
moe_offload_tiny.json lists each change (`changed`: field -> [released, written]; `removed`):

- the sizes given explicitly (layers, experts, top_k, hidden, heads, kv_heads, head_dim, expert_ffn, dense_ffn,
  vocab_size: each mapped onto the family's own field names by families.FIELDS), and what follows from the
  layer count: per-layer lists (`layer_types`) cut to the first N layers, layer-index lists (`mlp_only_layers`)
  kept below N, `max_window_layers` at most N, and `first_k_dense_replace` below N so that at least one layer
  is MoE;
- `pad_token_id` when it lies outside the written vocabulary (the embedding's padding row must exist): the
  tokenizer's pad token. BOS/EOS ids stay as released even outside the tokenizer's range, as released
  configs have them;
- the dtype fields when `dtype` is given, `quantization_config` when `quant` says otherwise, and `auto_map`
  (remote-code files this folder does not hold) is removed.

Weights are random (seeded), drawn with the released `initializer_range`, in the released dtype (`torch_dtype` /
`dtype`; bfloat16 for a quantized release that names none, as gpt-oss-20b) unless `dtype` is given. A released
`quantization_config` is honoured as make-tiny's `quant` is (gpt-oss-20b's MXFP4 experts; an FP8 release's
`weight_block_size` and `modules_to_not_convert`); `quant="none"` writes the model unquantized.

generation_config.json is the released kind: a folder's own generation_config.json verbatim when `like` is a
folder that has one; otherwise the config's bos/eos/pad ids (no pad_token_id where the release has none, an
EOS list kept a list) with greedy decoding.
"""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path
from typing import Any, Mapping

from .families import AUTO_CLASSES, MAX_POSITIONS, QUANT_FAMILIES, Size, quant_skips
from .heads import attention_sizes, invalid
from .like_config import Edit, apply_sizes, check_sizes, family_of, read_released, released_dtype, size_of
from .make import canonical_dtype, check_quant, check_width
from .tokenizer import BYTE_ALPHABET, PAD, build_tokenizer, family_special_tokens
from .write import Quantize, check_target, write_model

__all__ = ["make_like"]


def _quantize(released_qc: Any, quant: str | None, family: str, layers: int) -> tuple[str | None, Quantize | None]:
    """(the quant written, how) from the released quantization_config and an explicit `quant` ("none" drops it)."""
    if quant == "none":
        return None, None
    if quant is not None:
        return quant, Quantize(quant, quant_skips(family, layers, quant))
    if released_qc is None:
        return None, None
    method = released_qc.get("quant_method") if isinstance(released_qc, dict) else None
    if method not in QUANT_FAMILIES or family not in QUANT_FAMILIES[method]:
        raise invalid(f"the released quantization_config (quant_method {method!r}) cannot be written for {family}",
                      "make-tiny writes " + "; ".join(f"{q} for {', '.join(fs)}" for q, fs in QUANT_FAMILIES.items()),
                      "pass --quant none to write the model unquantized (or another --quant)")
    skips = released_qc.get("modules_to_not_convert")
    block = released_qc.get("weight_block_size")
    return method, Quantize(method, list(skips) if skips is not None else quant_skips(family, layers, method),
                            tuple(block) if block else None, dict(released_qc))


def make_like(
    out_dir: str | os.PathLike[str],
    like: str | os.PathLike[str] | Mapping[str, Any],
    *,
    family: str | None = None,
    layers: int | None = None,
    experts: int | None = None,
    top_k: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    expert_ffn: int | None = None,
    dense_ffn: int | None = None,
    vocab_size: int | None = None,
    seed: int = 0,
    dtype: str | None = None,
    quant: str | None = None,
    max_shard_size: int | str = "50GB",
    progress: bool | None = None,
) -> Path:
    """Write a random-weight model folder shaped as the released config `like` (module docstring) to `out_dir`.

    Every size left None is the released one (`layers` None: all of its layers); the given ones override it.
    `family`, when given, must be the config's model_type. `quant`: "fp8", "mxfp4", "none" (unquantized even if
    the release is quantized) or None (as released). Returns the folder's absolute path. Raises ValueError (an
    unreadable or malformed config, a model_type make-tiny cannot write, impossible sizes, a checkpoint larger
    than the free disk space) or FileExistsError (a non-empty target) before anything is written; the folder
    appears atomically."""
    released = read_released(like)
    family = family_of(released, family)
    for name, value in (("layers", layers), ("experts", experts), ("top_k", top_k), ("hidden", hidden),
                        ("heads", heads), ("kv_heads", kv_heads), ("head_dim", head_dim), ("expert_ffn", expert_ffn),
                        ("dense_ffn", dense_ffn), ("vocab_size", vocab_size)):
        check_width(name, value)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise invalid(f"seed={seed!r} is not an integer", "it seeds torch's generator", "pass an int")
    if quant not in (None, "none", *QUANT_FAMILIES):
        raise invalid(f"unknown quant {quant!r}", "tiny checkpoints are quantized as fp8 or mxfp4",
                      "pass quant='fp8', 'mxfp4' or 'none'")

    edit = Edit(copy.deepcopy(released.config), "text_config." if isinstance(released.config.get("text_config"),
                                                                              dict) else "")
    apply_sizes(edit, family, layers=layers, experts=experts, top_k=top_k, hidden=hidden, heads=heads,
                 kv_heads=kv_heads, head_dim=head_dim, expert_ffn=expert_ffn, dense_ffn=dense_ffn,
                 vocab_size=vocab_size)
    text = edit.text
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if not isinstance(text.get(key), int) or isinstance(text.get(key), bool) or text[key] < 1:
            raise invalid(f"{released.source} has {edit.text_path}{key}={text.get(key)!r}", "a model needs it as a "
                          "positive integer", "give the config.json as released")
    check_sizes(text, family, released.source)
    if any(v is not None for v in (hidden, heads, kv_heads, head_dim)):
        attention_sizes(family, text["hidden_size"], text["num_attention_heads"],
                        text.get("num_key_value_heads"), head_dim)
    n_special = len(family_special_tokens(family))
    vocab = text["vocab_size"]
    if vocab < BYTE_ALPHABET + n_special:
        raise invalid(f"vocab_size={vocab} is too small", f"the tokenizer needs all {BYTE_ALPHABET} byte tokens plus "
                      f"{n_special} special tokens", f"give --vocab {BYTE_ALPHABET + n_special} or more")
    layers = text["num_hidden_layers"]
    written_quant, quantize = _quantize(released.config.get("quantization_config"), quant, family, layers)
    if written_quant is not None:
        expert_width = size_of(text, family, Size.EXPERT_FFN)
        check_quant(written_quant, family, text["hidden_size"],
                    expert_width if isinstance(expert_width, int) else None)
    if written_quant is None:
        edit.remove("quantization_config")
    # A quantized release keeps its other tensors in bfloat16 (gpt-oss-20b names no dtype).
    quantized_release = written_quant is not None or released.config.get("quantization_config") is not None
    dtype = canonical_dtype(dtype) if dtype is not None else (
        released_dtype(released.config) or ("bfloat16" if quantized_release else "float32"))
    for key in ("torch_dtype", "dtype"):
        if key in edit.config and edit.config[key] != dtype:
            edit.set(key, dtype, top=True)
    if not any(key in edit.config for key in ("torch_dtype", "dtype")):
        edit.set("dtype", dtype, top=True)
    edit.remove("auto_map")   # remote code this folder does not hold
    out = Path(out_dir).expanduser().absolute()
    check_target(out)

    tokenizer_pad = family_special_tokens(family).index(PAD)
    for top in (True, False) if edit.text_path else (True,):
        pad = (edit.config if top else text).get("pad_token_id")
        if isinstance(pad, int) and not 0 <= pad < vocab:
            edit.set("pad_token_id", tokenizer_pad, top=top)   # the embedding's padding row must exist
    # Heavy imports only once the arguments are known to be good.
    import transformers

    config = _build_config(edit.config, family, released.source)
    model_bytes = _check_space(config, family, dtype, out, twice=written_quant is not None)
    tokenizer = build_tokenizer(vocab, family, MAX_POSITIONS)
    assert tokenizer.pad_token_id == tokenizer_pad, "the tokenizer's special tokens come first, in their order"

    written = edit.config
    generation_json = copy.deepcopy(released.generation) if released.generation is not None else None
    generation = {k: written.get(k, text.get(k)) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    if generation_json is None:
        generation_json = {k: v for k, v in generation.items() if v is not None}
        generation_json.update(do_sample=False, transformers_version=transformers.__version__)
    record = {
        "family": family,
        "layers": layers,
        "experts": size_of(text, family, Size.EXPERTS),
        "top_k": size_of(text, family, Size.TOP_K),
        "hidden": text["hidden_size"],
        "heads": text["num_attention_heads"],
        "kv_heads": text.get("num_key_value_heads", text["num_attention_heads"]),
        "head_dim": getattr(config.get_text_config(), "head_dim", None),
        "expert_ffn": size_of(text, family, Size.EXPERT_FFN),
        "dense_ffn": size_of(text, family, Size.DENSE_FFN),
        "seed": seed,
        "dtype": dtype,
        "quant": written_quant,
        "vocab_size": vocab,
        "auto_class": AUTO_CLASSES[family],
        "transformers_version": transformers.__version__,
        "like": {"source": released.source, "model_type": released.config["model_type"],
                 "released_layers": released.config.get("num_hidden_layers",
                                                         (released.config.get("text_config") or {}).get(
                                                             "num_hidden_layers")),
                 "changed": edit.changed, "removed": edit.removed, "bytes_unquantized": model_bytes},
    }
    return write_model(out, family=family, config=config, dtype=dtype, tokenizer=tokenizer, generation=generation,
                       record=record, seed=seed, quantize=quantize, config_json=written,
                       generation_json=generation_json, max_shard_size=max_shard_size, progress=progress)


def _build_config(data: dict[str, Any], family: str, source: str):
    """The transformers config of the written config.json (without quantization_config: the weights are drawn
    unquantized and quantized after), as from_pretrained will read it."""
    from transformers import CONFIG_MAPPING

    data = {k: v for k, v in data.items() if k != "quantization_config"}
    try:
        return CONFIG_MAPPING[family].from_dict(copy.deepcopy(data))
    except Exception as exc:   # transformers' validation: any of its errors means the config cannot be built
        raise invalid(f"transformers cannot build a {family} model from {source} as written",
                      f"{type(exc).__name__}: {' '.join(str(exc).split())}",
                      "check the sizes given, or give the config.json as released") from exc


def _check_space(config, family: str, dtype: str, out: Path, *, twice: bool) -> int:
    """The checkpoint's unquantized bytes; ValueError when the file system holding `out` has less room than it
    (twice that for a quantized one: the unquantized shard is rewritten beside itself)."""
    import torch
    import transformers

    from ..formats.stream_save import meta_model

    try:
        model = meta_model(getattr(transformers, AUTO_CLASSES[family]), config, getattr(torch, dtype))
    except Exception as exc:
        raise invalid(f"transformers cannot build the {family} model of this config",
                      f"{type(exc).__name__}: {' '.join(str(exc).split())}", "check the sizes given") from exc
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    base = out.parent
    while not base.exists():
        base = base.parent
    free = shutil.disk_usage(base).free
    need = total * (2 if twice else 1)
    if need > free:
        gib = 1 << 30
        raise invalid(f"the checkpoint needs {need / gib:.1f} GiB but {base} has {free / gib:.1f} GiB free",
                      f"{config.get_text_config().num_hidden_layers} layers of this model take "
                      f"{total / gib:.1f} GiB in {dtype}", "give fewer --layers, or write it elsewhere")
    return total
