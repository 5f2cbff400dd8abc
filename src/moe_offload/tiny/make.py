"""Write tiny random-weight Mixture-of-Experts checkpoints for tests and demos.

``make_tiny(out_dir, family=...)`` builds a small model of a real transformers MoE
architecture (Qwen3-MoE, Mixtral, DeepSeek-V3, gpt-oss, ...) with random weights, and
writes it as an ordinary Hugging Face model folder:

* ``config.json`` and ``generation_config.json``;
* ``model.safetensors`` (shards and ``model.safetensors.index.json`` with a smaller
  ``max_shard_size``), in the layout the model's own ``save_pretrained`` writes, so the tensor
  names, shapes, dtypes and per-expert/fused layout on disk are exactly what transformers writes
  for that architecture. It is streamed tensor by tensor from a meta-device model
  (:mod:`moe_offload.formats.stream_save`), so peak memory is a few times the largest tensor,
  not the model. Per-expert tensors (``...experts.3.down_proj.weight``) for the
  Qwen/Mixtral/DeepSeek/OLMoE/PhiMoE/GLM/Jamba families, fused ``[E, ...]`` tensors for
  gpt-oss, GraniteMoE and Qwen3-VL-MoE. One departure, toward the released checkpoints: for
  Qwen3-VL-MoE save_pretrained writes its in-memory orientation, ``gate_up_proj`` ``[E, 2*I, H]``,
  where released checkpoints (and llama.cpp's converter) have ``[E, H, 2*I]``: make-tiny writes the
  released one (released.py; transformers' loader accepts both). In half precision, tensors that
  transformers keeps in float32 (``_keep_in_fp32_modules``, e.g. DeepSeek/GLM router
  weights, gpt-oss norms in float16) stay float32 on disk too;
* a BPE tokenizer trained on :data:`moe_offload.prompts.CORPUS` (tokenizer.py: byte-level, or
  SentencePiece-style for Jamba; ``tokenizer.json`` + ``tokenizer_config.json``);
* ``moe_offload_tiny.json`` recording the arguments it was made with.

The folder loads offline with ``AutoTokenizer.from_pretrained(dir)`` and the Auto class
named in :data:`moe_offload.tiny.families.AUTO_CLASSES` (``AutoModelForCausalLM`` for every
family except ``qwen3_vl_moe``, which transformers only registers as an image-text-to-text model).
Nothing is downloaded. The same arguments always give byte-identical weights. A progress bar
(bytes written) shows on a terminal.

Here: the argument checks and the config of the model asked for. Each family's config fields are families.py's,
its attention heads heads.py's, the writing (target checks, streamed weights, atomic rename) write.py's, the
quantized rewrite (``quant=``) quantize.py's; a released model's shape (``--like``) make_like.py's.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from .families import (AUTO_CLASSES, EXACT_TOP_K, FAMILIES, MAX_POSITIONS, MIN_EXPERTS, QUANT_FAMILIES,
                       Size, family_config, quant_skips, size_fields)
from .heads import attention_sizes, invalid
from .tokenizer import BYTE_ALPHABET, VISION_TOKENS, build_tokenizer, family_special_tokens
from .write import Quantize, check_target, write_model

__all__ = ["DTYPES", "make_tiny", "canonical_dtype", "check_quant", "check_width"]

DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def canonical_dtype(dtype: str) -> str:
    name = _DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower())
    if name not in DTYPES:
        raise invalid(
            f"unsupported dtype {dtype!r}",
            f"tiny checkpoints are written in one of {', '.join(DTYPES)}",
            "pass dtype='float32', 'bfloat16' or 'float16'",
        )
    return name


def _check_args(
    family: str, layers: int, experts: int, top_k: int, hidden: int, vocab_size: int, n_special: int
) -> None:
    """Reject bad arguments before anything is built or written."""
    if family not in FAMILIES:
        raise ValueError(
            f"unknown model family {family!r}: make_tiny only knows how to build "
            f"{', '.join(FAMILIES)}. Fix: pass one of these as family."
        )
    for name, value in (("layers", layers), ("experts", experts), ("top_k", top_k), ("hidden", hidden)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise invalid(f"{name}={value!r} is not an integer", f"{name} counts model units", "pass an int")
    if layers < 1:
        raise invalid(f"layers={layers} is invalid", "a model needs at least one decoder layer", "pass layers >= 1")
    if experts < 1:
        raise invalid(f"experts={experts} is invalid", "an MoE layer needs at least one routed expert",
                      "pass experts >= 1")
    if top_k < 1 or top_k > experts:
        raise invalid(
            f"top_k={top_k} is invalid for experts={experts}",
            "each token is routed to top_k distinct experts, so 1 <= top_k <= experts",
            f"pass a top_k between 1 and {experts}, or more experts",
        )
    min_e = MIN_EXPERTS.get(family, 1)
    if experts < min_e:
        raise invalid(
            f"experts={experts} is too few for {family}",
            f"its group-limited router ranks each expert group by its best {min_e} experts",
            f"pass experts >= {min_e}",
        )
    exact_k = EXACT_TOP_K.get(family)
    if exact_k is not None and top_k != exact_k:
        raise invalid(
            f"top_k={top_k} is not supported for {family}",
            f"its sparsemixer router always selects exactly {exact_k} experts",
            f"pass top_k={exact_k}",
        )
    if hidden < 16 or hidden % 16 != 0:
        raise invalid(
            f"hidden={hidden} is invalid",
            "it must be a multiple of 16, so that the sizes derived from it (experts 1.5 x hidden wide, "
            "half-size latent ranks and vision tower, 4 default heads rotated in pairs) stay whole",
            "pass a multiple of 16, e.g. 64",
        )
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < BYTE_ALPHABET + n_special:
        raise invalid(
            f"vocab_size={vocab_size!r} is too small",
            f"the tokenizer needs all {BYTE_ALPHABET} byte tokens (its byte-level alphabet or byte fallback) plus "
            f"{n_special} special tokens",
            f"pass vocab_size >= {BYTE_ALPHABET + n_special}",
        )


def check_quant(quant: str | None, family: str, hidden: int, expert_ffn: int | None = None) -> None:
    """Refuse a `quant` the family is not written in, or expert sizes MXFP4 cannot group (`expert_ffn` None:
    make-tiny's default width, 1.5 x hidden)."""
    if quant is None:
        return
    if quant not in QUANT_FAMILIES:
        raise invalid(f"unknown quant {quant!r}", "tiny checkpoints are quantized as fp8 or mxfp4",
                    "pass quant='fp8' or quant='mxfp4'")
    if family not in QUANT_FAMILIES[quant]:
        raise invalid(f"quant={quant!r} is not available for {family}",
                    f"{quant} checkpoints are written for {', '.join(QUANT_FAMILIES[quant])}",
                    "pick one of these families, or another quant")
    if quant == "mxfp4" and expert_ffn is None and hidden % 64:
        raise invalid(f"hidden={hidden} is invalid for mxfp4",
                    "MXFP4 groups 32 values along each input dimension: the hidden size and the experts' "
                    "width (1.5 x hidden) must both be multiples of 32", "pass a multiple of 64, e.g. 64")
    if quant == "mxfp4" and expert_ffn is not None and (hidden % 32 or expert_ffn % 32):
        raise invalid(f"hidden={hidden} and expert_ffn={expert_ffn} are invalid for mxfp4",
                    "MXFP4 groups 32 values along each input dimension: the hidden size and the experts' "
                    "width must both be multiples of 32", "pass multiples of 32, e.g. 64")


def check_width(name: str, value: int | None) -> None:
    """A width (expert_ffn, dense_ffn, vocab_size...) given by the caller is a positive int."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"{name}={value!r} is not an integer", f"{name} counts model units", "pass an int")
    if value < 1:
        raise invalid(f"{name}={value} is invalid", f"a layer needs {name} >= 1", f"pass {name} >= 1")


def make_tiny(
    out_dir: str | os.PathLike[str],
    *,
    family: str,
    layers: int = 2,
    experts: int = 8,
    top_k: int = 2,
    hidden: int = 64,
    heads: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    expert_ffn: int | None = None,
    dense_ffn: int | None = None,
    seed: int = 0,
    dtype: str | None = None,
    vocab_size: int = 512,
    quant: str | None = None,
    max_shard_size: int | str = "50GB",
    progress: bool | None = None,
) -> Path:
    """Write a tiny random-weight MoE model folder of the given ``family`` to ``out_dir``.

    ``layers`` decoder layers, ``experts`` routed experts per MoE layer of which ``top_k``
    are used per token, hidden size ``hidden`` (a multiple of 16), weights drawn from
    ``seed`` and saved in ``dtype`` ("float32", "bfloat16" or "float16"; "fp32", "bf16",
    "fp16" also accepted; default float32, bfloat16 with ``quant``), and a tokenizer of
    exactly ``vocab_size`` tokens (at least 260; 264 for qwen3_vl_moe and glm4_moe, whose vision
    placeholders / GLM tokens are special tokens). Returns the folder's absolute path.

    Widths: ``expert_ffn`` is each routed expert's intermediate size (default 1.5 x hidden), ``dense_ffn``
    the dense MLP's (and, where make-tiny sizes it so, the shared expert's: qwen2_moe) intermediate size
    (default 2 x hidden; refused for families without one, such as mixtral and gpt_oss). A released model's
    every dimension and field: :func:`moe_offload.tiny.make_like.make_like`.

    Attention: ``heads`` query heads (default 4), ``kv_heads`` key/value heads (default heads // 2, or
    heads where that is odd; always heads for DeepSeek's MLA and OLMoE) of ``head_dim`` each (default
    hidden // heads; a multiple of 4). Families with a head_dim field of their own
    (:data:`moe_offload.tiny.families.HEAD_DIM_FIELD`: Qwen3-MoE, Mixtral, gpt-oss, ...) take any head_dim
    whatever the hidden size, as the released ones do (Qwen3-30B-A3B: hidden 2048, 32 x 128); the others
    need hidden == heads x head_dim (:mod:`moe_offload.tiny.heads`).

    ``quant`` ("fp8" or "mxfp4", see :data:`moe_offload.tiny.families.QUANT_FAMILIES`) then rewrites the
    weights in the on-disk format the released models use
    (:func:`moe_offload.tiny.quantize.quantize_checkpoint`):
    FP8 e4m3 Linear and expert weights with ``weight_scale_inv`` block scales (DeepSeek-V3,
    Qwen3-FP8; the block is the largest power of two up to 128x128 that tiles the tiny
    matrices exactly), or gpt-oss MXFP4 experts (``*_blocks`` / ``*_scales``); the other
    tensors stay in ``dtype``, and config.json gets the matching ``quantization_config``.

    ``max_shard_size`` (bytes, or a string such as "2GB", as ``save_pretrained`` takes it;
    the same default) splits the weights into shards. ``progress``: show a progress bar on
    stderr (default: when stderr is a terminal).

    The folder appears atomically (built in a temporary sibling, then renamed). Raises
    ``FileExistsError`` if ``out_dir`` exists and is not an empty directory, and
    ``ValueError`` for an unknown family or impossible sizes, before writing anything.
    """
    # Released quantized checkpoints keep their unquantized tensors in bfloat16.
    dtype = canonical_dtype(dtype if dtype is not None else ("bfloat16" if quant else "float32"))
    _check_args(family, layers, experts, top_k, hidden, vocab_size,
                len(family_special_tokens(family)) if family in FAMILIES else 0)
    attn = attention_sizes(family, hidden, heads, kv_heads, head_dim)
    check_width("expert_ffn", expert_ffn)
    check_width("dense_ffn", dense_ffn)
    if dense_ffn is not None and not size_fields(family, Size.DENSE_FFN):
        raise invalid(f"dense_ffn={dense_ffn} is invalid for {family}",
                      f"{family} has no dense MLP or shared expert: its intermediate_size is each expert's width",
                      "leave dense_ffn out, or give expert_ffn")
    check_quant(quant, family, hidden, expert_ffn)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise invalid(f"seed={seed!r} is not an integer", "it seeds torch's generator", "pass an int")
    out = Path(out_dir).expanduser().absolute()
    check_target(out)

    # Heavy imports only once the arguments are known to be good.
    import transformers
    from transformers import AutoConfig

    tokenizer = build_tokenizer(vocab_size, family, MAX_POSITIONS)
    params: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden=hidden,
        heads=attn.heads,
        kv_heads=attn.kv_heads,
        head_dim=attn.head_dim,
        expert_ffn=3 * hidden // 2 if expert_ffn is None else expert_ffn,
        dense_ffn=2 * hidden if dense_ffn is None else dense_ffn,
        layers=layers,
        experts=experts,
        top_k=top_k,
        # transformers' default std (0.02) gives router logits so flat that every token
        # picks nearly the same experts; ~1/sqrt(hidden) gives unit-scale logits, so
        # routing varies from token to token and outputs are far from zero.
        init_std=round(1.0 / math.sqrt(hidden), 6),
        bos=tokenizer.bos_token_id,
        eos=tokenizer.eos_token_id,
        pad=tokenizer.pad_token_id,
        vision_token_ids={t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS},
    )
    config = AutoConfig.for_model(family, **family_config(family, params))
    record = {
        "family": family,
        "layers": layers,
        "experts": experts,
        "top_k": top_k,
        "hidden": hidden,
        "heads": attn.heads,
        "kv_heads": attn.kv_heads,
        "head_dim": attn.head_dim,
        "expert_ffn": params["expert_ffn"],
        "dense_ffn": params["dense_ffn"] if size_fields(family, Size.DENSE_FFN) else None,
        "seed": seed,
        "dtype": dtype,
        "quant": quant,
        "vocab_size": len(tokenizer),
        "auto_class": AUTO_CLASSES[family],
        "transformers_version": transformers.__version__,
    }
    generation = dict(bos_token_id=params["bos"], eos_token_id=params["eos"], pad_token_id=params["pad"],
                      do_sample=False)  # greedy by default: tests and benchmarks compare exact tokens
    quantize = None if quant is None else Quantize(quant, quant_skips(family, layers, quant))
    return write_model(out, family=family, config=config, dtype=dtype, tokenizer=tokenizer, generation=generation,
                       record=record, seed=seed, quantize=quantize, max_shard_size=max_shard_size,
                       progress=progress)
