"""Write tiny random-weight Mixture-of-Experts checkpoints for tests and demos.

``make_tiny(out_dir, family=...)`` builds a small model of a real transformers MoE
architecture (Qwen3-MoE, Mixtral, DeepSeek-V3, gpt-oss, ...) with random weights, and
writes it as an ordinary Hugging Face model folder:

* ``config.json`` and ``generation_config.json``;
* ``model.safetensors`` (shards and ``model.safetensors.index.json`` with a smaller
  ``max_shard_size``), in the layout the model's own ``save_pretrained`` writes, so the tensor
  names, shapes, dtypes and per-expert/fused layout on disk are exactly what transformers writes
  for that architecture. It is streamed tensor by tensor from a meta-device model
  (:mod:`moe_offload.stream_save`), so peak memory is a few times the largest tensor, not the
  model. Per-expert tensors (``...experts.3.down_proj.weight``) for the
  Qwen/Mixtral/DeepSeek/OLMoE/PhiMoE/GLM/Jamba families, fused ``[E, ...]`` tensors for
  gpt-oss, GraniteMoE and Qwen3-VL-MoE. (For Qwen3-VL-MoE transformers writes its
  in-memory orientation, ``gate_up_proj`` ``[E, 2*I, H]``; released checkpoints store
  ``[E, H, 2*I]``, and transformers' loader accepts both.) In half precision, tensors that
  transformers keeps in float32 (``_keep_in_fp32_modules``, e.g. DeepSeek/GLM router
  weights, gpt-oss norms in float16) stay float32 on disk too;
* a byte-level BPE tokenizer trained on :data:`moe_offload.prompts.CORPUS`
  (``tokenizer.json`` + ``tokenizer_config.json``);
* ``moe_offload_tiny.json`` recording the arguments it was made with.

The folder loads offline with ``AutoTokenizer.from_pretrained(dir)`` and the Auto class
named in :data:`AUTO_CLASSES` (``AutoModelForCausalLM`` for every family except
``qwen3_vl_moe``, which transformers only registers as an image-text-to-text model).
Nothing is downloaded. The same arguments always give byte-identical weights. A progress bar
(bytes written) shows on a terminal.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

__all__ = ["FAMILIES", "AUTO_CLASSES", "DTYPES", "QUANT_FAMILIES", "make_tiny"]

# Attention heads in every tiny model. Four heads with two KV heads exercises grouped-query
# attention while keeping the per-head size reasonable at hidden=64.
_HEADS = 4
_KV_HEADS = 2
# Short context: the tiny models only ever see prompts of a few dozen tokens, and the
# rotary/position tables then stay negligible next to the expert weights.
_MAX_POSITIONS = 512

# Special tokens of the tiny tokenizer. Llama order (<unk>, <s>, </s>) plus a pad token.
_UNK, _BOS, _EOS, _PAD = "<unk>", "<s>", "</s>", "<pad>"
_SPECIAL_TOKENS = (_UNK, _BOS, _EOS, _PAD)
# Qwen3-VL looks these ids up in input_ids; give them real tokens inside the tiny vocab
# instead of Qwen's 151k-range ids, which would be out of range for a 512-token embedding.
_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
_BYTE_ALPHABET = 256  # a byte-level BPE always keeps all 256 byte symbols

DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def _common(p: dict[str, Any]) -> dict[str, Any]:
    """Config fields every family shares (all of them accept these names)."""
    return dict(
        vocab_size=p["vocab_size"],
        hidden_size=p["hidden"],
        num_hidden_layers=p["layers"],
        num_attention_heads=_HEADS,
        num_key_value_heads=_KV_HEADS,
        max_position_embeddings=_MAX_POSITIONS,
        initializer_range=p["init_std"],
        tie_word_embeddings=False,
        bos_token_id=p["bos"],
        eos_token_id=p["eos"],
        pad_token_id=p["pad"],
    )


# --- one config builder per family -------------------------------------------------------
# Each maps the generic (experts, top_k, hidden) onto the family's own field names. Expert
# FFNs are 1.5*hidden wide and dense FFNs 2*hidden, so routed experts hold most of the
# parameters, as in real MoE checkpoints, and no expert matrix is square: a transposed
# expert weight then always shows up as a shape mismatch instead of silently loading.


def _qwen3_moe(p: dict[str, Any]) -> dict[str, Any]:
    return dict(
        _common(p),
        head_dim=p["head_dim"],
        intermediate_size=p["dense_ffn"],
        moe_intermediate_size=p["expert_ffn"],
        num_experts=p["experts"],
        num_experts_per_tok=p["top_k"],
        norm_topk_prob=True,  # as in the released Qwen3 MoE checkpoints
    )


def _qwen2_moe(p: dict[str, Any]) -> dict[str, Any]:
    return dict(
        _common(p),
        intermediate_size=p["dense_ffn"],
        moe_intermediate_size=p["expert_ffn"],
        # Qwen2-MoE always has exactly one (gated) shared expert; keep it so planners see
        # the shared_expert role.
        shared_expert_intermediate_size=p["dense_ffn"],
        num_experts=p["experts"],
        num_experts_per_tok=p["top_k"],
    )


def _mixtral(p: dict[str, Any]) -> dict[str, Any]:
    # Mixtral has no dense FFN: intermediate_size is each expert's width.
    return dict(
        _common(p),
        head_dim=p["head_dim"],
        intermediate_size=p["expert_ffn"],
        num_local_experts=p["experts"],
        num_experts_per_tok=p["top_k"],
    )


def _deepseek_mla(p: dict[str, Any]) -> dict[str, Any]:
    """Multi-head latent attention sizes shared by DeepSeek-V2 and -V3."""
    hd = p["head_dim"]
    return dict(
        num_key_value_heads=_HEADS,  # MLA has no grouped KV heads
        kv_lora_rank=p["hidden"] // 2,
        qk_nope_head_dim=hd,
        qk_rope_head_dim=hd // 2,
        v_head_dim=hd,
        intermediate_size=p["dense_ffn"],
        moe_intermediate_size=p["expert_ffn"],
        n_routed_experts=p["experts"],
        num_experts_per_tok=p["top_k"],
        n_shared_experts=1,
        # One leading dense layer, like the real models, whenever there is room for an
        # MoE layer after it.
        first_k_dense_replace=1 if p["layers"] >= 2 else 0,
    )


def _deepseek_v3(p: dict[str, Any]) -> dict[str, Any]:
    return dict(
        _common(p),
        **_deepseek_mla(p),
        q_lora_rank=p["hidden"] // 2,
        # Group-limited routing with one group: valid for any expert count, still runs
        # the group-selection code path.
        n_group=1,
        topk_group=1,
    )


def _deepseek_v2(p: dict[str, Any]) -> dict[str, Any]:
    # DeepSeek-V2-Lite style: no query compression, plain greedy top-k routing.
    return dict(_common(p), **_deepseek_mla(p), q_lora_rank=None, topk_method="greedy")


def _gpt_oss(p: dict[str, Any]) -> dict[str, Any]:
    return dict(
        _common(p),
        head_dim=p["head_dim"],
        intermediate_size=p["expert_ffn"],  # gpt-oss has only expert FFNs
        num_local_experts=p["experts"],
        num_experts_per_tok=p["top_k"],
        # Shorter than the prompts used in tests, so the sliding layers really slide.
        sliding_window=16,
        # Keep gpt-oss's YaRN rope, rescaled to the tiny context.
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": _MAX_POSITIONS // 4,
        },
    )


def _qwen3_vl_moe(p: dict[str, Any]) -> dict[str, Any]:
    half = p["head_dim"] // 2
    # Interleaved M-RoPE splits the rotary half-dimension over (time, height, width);
    # the sections must add up to head_dim // 2 (Qwen uses 24/20/20 of 64).
    mrope = [half - 2 * (half // 4), half // 4, half // 4]
    text = dict(_qwen3_moe(p), model_type="qwen3_vl_moe_text")
    text.pop("norm_topk_prob")  # the VL text config has no such field (always normalised)
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 5000000.0,
        "mrope_section": mrope,
        "mrope_interleaved": True,
    }
    vision_hidden = max(16, p["hidden"] // 2)
    vision = dict(
        model_type="qwen3_vl_moe_vision",
        depth=2,
        hidden_size=vision_hidden,
        intermediate_size=2 * vision_hidden,
        num_heads=2,
        patch_size=16,
        temporal_patch_size=2,
        spatial_merge_size=2,
        out_hidden_size=p["hidden"],
        num_position_embeddings=64,  # must be a square (an 8x8 grid of learned positions)
        deepstack_visual_indexes=[0],
        initializer_range=p["init_std"],
    )
    vt = p["vision_token_ids"]
    return dict(
        text_config=text,
        vision_config=vision,
        vision_start_token_id=vt["<|vision_start|>"],
        vision_end_token_id=vt["<|vision_end|>"],
        image_token_id=vt["<|image_pad|>"],
        video_token_id=vt["<|video_pad|>"],
        tie_word_embeddings=False,
        bos_token_id=p["bos"],
        eos_token_id=p["eos"],
        pad_token_id=p["pad"],
    )


def _olmoe(p: dict[str, Any]) -> dict[str, Any]:
    return dict(
        _common(p),
        intermediate_size=p["expert_ffn"],  # OLMoE: expert width, no dense FFN
        num_experts=p["experts"],
        num_experts_per_tok=p["top_k"],
    )


def _phimoe(p: dict[str, Any]) -> dict[str, Any]:
    return dict(
        _common(p),
        intermediate_size=p["expert_ffn"],
        num_local_experts=p["experts"],
        num_experts_per_tok=p["top_k"],
    )


def _granitemoe(p: dict[str, Any]) -> dict[str, Any]:
    return dict(
        _common(p),
        intermediate_size=p["expert_ffn"],
        num_local_experts=p["experts"],
        num_experts_per_tok=p["top_k"],
    )


def _glm4_moe(p: dict[str, Any]) -> dict[str, Any]:
    return dict(
        _common(p),
        head_dim=p["head_dim"],
        intermediate_size=p["dense_ffn"],
        moe_intermediate_size=p["expert_ffn"],
        n_routed_experts=p["experts"],
        num_experts_per_tok=p["top_k"],
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1 if p["layers"] >= 2 else 0,
    )


def _qwen3_next(p: dict[str, Any]) -> dict[str, Any]:
    layers = p["layers"]
    return dict(
        _common(p),
        head_dim=p["head_dim"],
        intermediate_size=p["dense_ffn"],
        moe_intermediate_size=p["expert_ffn"],
        shared_expert_intermediate_size=p["expert_ffn"],
        num_experts=p["experts"],
        num_experts_per_tok=p["top_k"],
        # Alternate linear (gated delta-net) and full attention so that even a 2-layer
        # model has both kinds; the real model uses one full layer in four. A 1-layer model
        # gets a full-attention layer: transformers' hybrid cache cannot generate without one.
        layer_types=(
            ["full_attention"]
            if layers == 1
            else ["linear_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        ),
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=p["head_dim"],
        linear_value_head_dim=p["head_dim"],
    )


def _jamba(p: dict[str, Any]) -> dict[str, Any]:
    layers = p["layers"]
    return dict(
        _common(p),
        intermediate_size=p["expert_ffn"],
        num_experts=p["experts"],
        num_experts_per_tok=p["top_k"],
        # Real Jamba: attention in 1 layer of 8, MoE every 2nd layer. Shrink the periods so
        # a 2-layer model has one attention + one Mamba layer, and at least one MoE layer.
        attn_layer_period=2 if layers >= 2 else 1,
        attn_layer_offset=0,
        expert_layer_period=2 if layers >= 2 else 1,
        expert_layer_offset=1 if layers >= 2 else 0,
        mamba_d_state=8,
    )


_BUILDERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "qwen3_moe": _qwen3_moe,
    "qwen2_moe": _qwen2_moe,
    "mixtral": _mixtral,
    "deepseek_v3": _deepseek_v3,
    "gpt_oss": _gpt_oss,
    "qwen3_vl_moe": _qwen3_vl_moe,
    "olmoe": _olmoe,
    "phimoe": _phimoe,
    "granitemoe": _granitemoe,
    "deepseek_v2": _deepseek_v2,
    "glm4_moe": _glm4_moe,
    "qwen3_next": _qwen3_next,
    "jamba": _jamba,
}

FAMILIES: tuple[str, ...] = tuple(_BUILDERS)

# The transformers Auto class that loads each family for text generation. transformers 5.x
# registers Qwen3-VL-MoE only under image-text-to-text (Qwen3VLMoeForConditionalGeneration),
# not under AutoModelForCausalLM; it still generates from text-only input.
AUTO_CLASSES: dict[str, str] = {
    f: ("AutoModelForImageTextToText" if f == "qwen3_vl_moe" else "AutoModelForCausalLM")
    for f in FAMILIES
}

# Families whose router needs more than the generic 1 <= top_k <= experts.
_MIN_EXPERTS = {
    # Group-limited routing scores each group by its top-2 experts (torch.topk(2)).
    "deepseek_v3": 2,
    "glm4_moe": 2,
}
_EXACT_TOP_K = {
    # PhiMoE's sparsemixer router is hard-wired to pick exactly two experts.
    "phimoe": 2,
}


def _fail(what: str, why: str, fix: str) -> ValueError:
    return ValueError(f"{what}: {why}. Fix: {fix}.")


def _canonical_dtype(dtype: str) -> str:
    name = _DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower())
    if name not in DTYPES:
        raise _fail(
            f"unsupported dtype {dtype!r}",
            f"tiny checkpoints are written in one of {', '.join(DTYPES)}",
            "pass dtype='float32', 'bfloat16' or 'float16'",
        )
    return name


def _check_args(
    family: str, layers: int, experts: int, top_k: int, hidden: int, vocab_size: int, n_special: int
) -> None:
    """Reject bad arguments before anything is built or written."""
    if family not in _BUILDERS:
        raise ValueError(
            f"unknown model family {family!r}: make_tiny only knows how to build "
            f"{', '.join(FAMILIES)}. Fix: pass one of these as family."
        )
    for name, value in (("layers", layers), ("experts", experts), ("top_k", top_k), ("hidden", hidden)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(f"{name}={value!r} is not an integer", f"{name} counts model units", "pass an int")
    if layers < 1:
        raise _fail(f"layers={layers} is invalid", "a model needs at least one decoder layer", "pass layers >= 1")
    if experts < 1:
        raise _fail(f"experts={experts} is invalid", "an MoE layer needs at least one routed expert", "pass experts >= 1")
    if top_k < 1 or top_k > experts:
        raise _fail(
            f"top_k={top_k} is invalid for experts={experts}",
            "each token is routed to top_k distinct experts, so 1 <= top_k <= experts",
            f"pass a top_k between 1 and {experts}, or more experts",
        )
    min_e = _MIN_EXPERTS.get(family, 1)
    if experts < min_e:
        raise _fail(
            f"experts={experts} is too few for {family}",
            f"its group-limited router ranks each expert group by its best {min_e} experts",
            f"pass experts >= {min_e}",
        )
    exact_k = _EXACT_TOP_K.get(family)
    if exact_k is not None and top_k != exact_k:
        raise _fail(
            f"top_k={top_k} is not supported for {family}",
            f"its sparsemixer router always selects exactly {exact_k} experts",
            f"pass top_k={exact_k}",
        )
    if hidden < 16 or hidden % (_HEADS * 4) != 0:
        raise _fail(
            f"hidden={hidden} is invalid",
            f"it must split into {_HEADS} attention heads whose size is divisible by 4 "
            "(rotary embeddings rotate pairs, and partial/decoupled rotary uses half a head)",
            f"pass a multiple of {_HEADS * 4}, e.g. 64",
        )
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < _BYTE_ALPHABET + n_special:
        raise _fail(
            f"vocab_size={vocab_size!r} is too small",
            f"a byte-level tokenizer needs all {_BYTE_ALPHABET} byte tokens plus {n_special} special tokens",
            f"pass vocab_size >= {_BYTE_ALPHABET + n_special}",
        )


# Families whose tiny checkpoints can be written quantized: those transformers itself loads in that
# format (gpt-oss is the only MXFP4 family; FP8 needs per-expert matrices on disk, which its
# dequantizing loader reads).
QUANT_FAMILIES: dict[str, tuple[str, ...]] = {
    "fp8": ("qwen3_moe", "deepseek_v3", "qwen2_moe", "mixtral", "olmoe", "glm4_moe"),
    "mxfp4": ("gpt_oss",),
}


def _check_quant(quant: str | None, family: str, hidden: int) -> None:
    if quant is None:
        return
    if quant not in QUANT_FAMILIES:
        raise _fail(f"unknown quant {quant!r}", "tiny checkpoints are quantized as fp8 or mxfp4",
                    "pass quant='fp8' or quant='mxfp4'")
    if family not in QUANT_FAMILIES[quant]:
        raise _fail(f"quant={quant!r} is not available for {family}",
                    f"{quant} checkpoints are written for {', '.join(QUANT_FAMILIES[quant])}",
                    "pick one of these families, or another quant")
    if quant == "mxfp4" and hidden % 64:
        raise _fail(f"hidden={hidden} is invalid for mxfp4",
                    "MXFP4 groups 32 values along each input dimension: the hidden size and the experts' "
                    "width (1.5 x hidden) must both be multiples of 32", "pass a multiple of 64, e.g. 64")


def _quant_skips(family: str, layers: int, quant: str) -> list[str] | None:
    """`modules_to_not_convert` in the style each family's released quantized config uses."""
    if quant == "mxfp4":  # gpt-oss: only the experts are MXFP4
        return ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
    if family == "deepseek_v3":
        return None  # DeepSeek-V3 ships no list: transformers' default keeps the LM head unquantized
    # In the style of Qwen3-FP8: the LM head, plus every layer's norms and router gate by name.
    per_layer = ("input_layernorm", "mlp.gate", "post_attention_layernorm")
    return ["lm_head", *(f"model.layers.{i}.{m}" for i in range(layers) for m in per_layer), "model.norm"]


def _check_target(out: Path) -> None:
    """Refuse a target make_tiny could not fill, before anything is built: FileExistsError (a file, or a
    non-empty folder), NotADirectoryError (a path through a file), PermissionError (nowhere to write)."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(
            f"cannot write a tiny model to {out}: it exists and is not a directory. "
            "Fix: choose a new path or remove that file."
        )
    if out.is_dir() and any(out.iterdir()):
        raise FileExistsError(
            f"cannot write a tiny model to {out}: the directory is not empty and make_tiny never "
            "overwrites existing files. Fix: choose a new or empty directory, or delete this one first."
        )
    # The folder is built next to `out` and renamed into place: its nearest existing ancestor must be a
    # directory we can create things in. Probed by doing it, since permission bits say nothing for root
    # (or on read-only and virtual file systems such as /sys).
    base = out.parent
    while not base.exists():
        base = base.parent
    if not base.is_dir():
        raise NotADirectoryError(
            f"cannot write a tiny model to {out}: {base} is a file, not a directory. "
            "Fix: choose a path whose parents are directories."
        )
    try:
        probe = tempfile.mkdtemp(prefix=f".{out.name}.probe-", dir=base)
    except OSError as exc:
        raise PermissionError(
            f"cannot write a tiny model to {out}: nothing can be created in {base} ({exc.strerror}). "
            "Fix: choose a directory you can write to."
        ) from exc
    os.rmdir(probe)


def _build_tokenizer(vocab_size: int, specials: tuple[str, ...], max_len: int):
    """Train a byte-level BPE on the built-in corpus with exactly ``vocab_size`` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from ..prompts import CORPUS, PROMPTS

    tok = Tokenizer(models.BPE(unk_token=_UNK))
    # GPT-2 style byte-level pipeline: any UTF-8 text encodes without <unk>, and decoding
    # gives back the exact input.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [para for para in CORPUS.split("\n\n") if para.strip()] + list(PROMPTS)
    tok.train_from_iterator(texts, trainer=trainer)
    # A few KB of text only supports so many merges; top a large vocab up with reserved
    # special tokens (as Llama 3 and Qwen do) so the size is exactly what was asked for.
    missing = vocab_size - tok.get_vocab_size(with_added_tokens=True)
    if missing > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    bos_id = tok.token_to_id(_BOS)
    # Prepend <s> like Llama/Mixtral tokenizers, so a prompt never starts the model cold.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{_BOS} $A",
        pair=f"{_BOS} $A {_BOS} $B",
        special_tokens=[(_BOS, bos_id)],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=_BOS,
        eos_token=_EOS,
        pad_token=_PAD,
        unk_token=_UNK,
        model_max_length=max_len,
    )
    if len(fast) != vocab_size:  # pragma: no cover - guards against a tokenizers change
        raise RuntimeError(f"tiny tokenizer has {len(fast)} tokens, expected {vocab_size}")
    return fast


def make_tiny(
    out_dir: str | os.PathLike[str],
    *,
    family: str,
    layers: int = 2,
    experts: int = 8,
    top_k: int = 2,
    hidden: int = 64,
    seed: int = 0,
    dtype: str | None = None,
    vocab_size: int = 512,
    quant: str | None = None,
    max_shard_size: int | str = "50GB",
    progress: bool | None = None,
) -> Path:
    """Write a tiny random-weight MoE model folder of the given ``family`` to ``out_dir``.

    ``layers`` decoder layers, ``experts`` routed experts per MoE layer of which ``top_k``
    are used per token, hidden size ``hidden`` (4 attention heads), weights drawn from
    ``seed`` and saved in ``dtype`` ("float32", "bfloat16" or "float16"; "fp32", "bf16",
    "fp16" also accepted; default float32, bfloat16 with ``quant``), and a tokenizer of
    exactly ``vocab_size`` tokens (at least 260; 264 for qwen3_vl_moe, whose vision
    placeholders are special tokens). Returns the folder's absolute path.

    ``quant`` ("fp8" or "mxfp4", see :data:`QUANT_FAMILIES`) then rewrites the weights in the
    on-disk format the released models use (:func:`moe_offload.quant.quantize_checkpoint`):
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
    dtype = _canonical_dtype(dtype if dtype is not None else ("bfloat16" if quant else "float32"))
    specials = _SPECIAL_TOKENS + (_VISION_TOKENS if family == "qwen3_vl_moe" else ())
    _check_args(family, layers, experts, top_k, hidden, vocab_size, len(specials))
    _check_quant(quant, family, hidden)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise _fail(f"seed={seed!r} is not an integer", "it seeds torch's generator", "pass an int")
    out = Path(out_dir).expanduser().absolute()
    _check_target(out)

    # Heavy imports only once the arguments are known to be good.
    import torch
    import transformers
    from transformers import AutoConfig, GenerationConfig

    tokenizer = _build_tokenizer(vocab_size, specials, _MAX_POSITIONS)
    params: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden=hidden,
        head_dim=hidden // _HEADS,
        expert_ffn=3 * hidden // 2,
        dense_ffn=2 * hidden,
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
        vision_token_ids={t: tokenizer.convert_tokens_to_ids(t) for t in _VISION_TOKENS},
    )
    config = AutoConfig.for_model(family, **_BUILDERS[family](params))
    auto_cls = getattr(transformers, AUTO_CLASSES[family])

    from ..formats.stream_save import meta_model

    # The model as from_pretrained(dtype=...) would hold it, on the meta device: no weight exists
    # yet; each is drawn, written and freed in turn by _write_weights.
    model = meta_model(auto_cls, config, getattr(torch, dtype))
    model.generation_config = GenerationConfig(
        bos_token_id=params["bos"],
        eos_token_id=params["eos"],
        pad_token_id=params["pad"],
        do_sample=False,  # greedy by default: tests and benchmarks compare exact tokens
    )

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        # mkdtemp creates the folder 0700; give the final folder ordinary permissions.
        tmp.chmod(0o755)
        _write_weights(model, tmp, seed=seed, max_shard_size=max_shard_size,
                       progress=_stderr_is_terminal() if progress is None else progress)
        if quant is not None:
            from ..formats.quant import QuantFormat, quantize_checkpoint

            skips = _quant_skips(family, layers, quant)
            quantize_checkpoint(tmp, model, QuantFormat(quant), modules_to_not_convert=skips)
        tokenizer.save_pretrained(tmp)
        record = {
            "family": family,
            "layers": layers,
            "experts": experts,
            "top_k": top_k,
            "hidden": hidden,
            "seed": seed,
            "dtype": dtype,
            "quant": quant,
            "vocab_size": len(tokenizer),
            "auto_class": AUTO_CLASSES[family],
            "transformers_version": transformers.__version__,
        }
        (tmp / "moe_offload_tiny.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        _check_target(out)  # someone may have filled it while we were building
        try:
            # POSIX rename atomically replaces an empty directory.
            os.replace(tmp, out)
        except OSError:
            if out.is_dir() and not any(out.iterdir()):
                out.rmdir()  # platforms where rename cannot replace a directory
                os.replace(tmp, out)
            else:
                raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _stderr_is_terminal() -> bool:
    import sys

    return sys.stderr is not None and sys.stderr.isatty()


def _write_weights(model: Any, dest: Path, *, seed: int, max_shard_size: int | str, progress: bool) -> None:
    """Stream the weights of meta-device ``model`` into ``dest`` (config and generation config too).

    Every floating tensor is drawn in float32 and rounded to its stored dtype, so the
    float16/bfloat16 checkpoints are roundings of the very same weights as the float32 one.
    """
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    from ..formats.stream_save import save_streaming

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True, disable=not progress) as bar:
        task = bar.add_task("make-tiny: writing weights", total=None)

        def advance(done: int, total: int, key: str) -> None:
            where = ".".join(key.split(".")[:3])   # model.layers.7: the decoder layer being written
            bar.update(task, completed=done, total=total, description=f"make-tiny: {where}")

        # fork_rng: seed only for our own draws, leaving the caller's global RNG state as it was.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            save_streaming(model, dest, max_shard_size=max_shard_size, progress=advance)
