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

Here: the argument and target checks, and the writing. Each family's config fields are families.py's, its
attention heads heads.py's, the quantized rewrite (``quant=``) quantize.py's.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from .families import (AUTO_CLASSES, EXACT_TOP_K, FAMILIES, MAX_POSITIONS, MIN_EXPERTS, QUANT_FAMILIES,
                       RELEASED_TRANSPOSED, family_config, quant_skips)
from .heads import attention_sizes, invalid
from .tokenizer import BYTE_ALPHABET, VISION_TOKENS, build_tokenizer, family_special_tokens

__all__ = ["DTYPES", "make_tiny"]

DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def _canonical_dtype(dtype: str) -> str:
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


def _check_quant(quant: str | None, family: str, hidden: int) -> None:
    if quant is None:
        return
    if quant not in QUANT_FAMILIES:
        raise invalid(f"unknown quant {quant!r}", "tiny checkpoints are quantized as fp8 or mxfp4",
                    "pass quant='fp8' or quant='mxfp4'")
    if family not in QUANT_FAMILIES[quant]:
        raise invalid(f"quant={quant!r} is not available for {family}",
                    f"{quant} checkpoints are written for {', '.join(QUANT_FAMILIES[quant])}",
                    "pick one of these families, or another quant")
    if quant == "mxfp4" and hidden % 64:
        raise invalid(f"hidden={hidden} is invalid for mxfp4",
                    "MXFP4 groups 32 values along each input dimension: the hidden size and the experts' "
                    "width (1.5 x hidden) must both be multiples of 32", "pass a multiple of 64, e.g. 64")


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
    dtype = _canonical_dtype(dtype if dtype is not None else ("bfloat16" if quant else "float32"))
    _check_args(family, layers, experts, top_k, hidden, vocab_size,
                len(family_special_tokens(family)) if family in FAMILIES else 0)
    attn = attention_sizes(family, hidden, heads, kv_heads, head_dim)
    _check_quant(quant, family, hidden)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise invalid(f"seed={seed!r} is not an integer", "it seeds torch's generator", "pass an int")
    out = Path(out_dir).expanduser().absolute()
    _check_target(out)

    # Heavy imports only once the arguments are known to be good.
    import torch
    import transformers
    from transformers import AutoConfig, GenerationConfig

    tokenizer = build_tokenizer(vocab_size, family, MAX_POSITIONS)
    params: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden=hidden,
        heads=attn.heads,
        kv_heads=attn.kv_heads,
        head_dim=attn.head_dim,
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
        vision_token_ids={t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS},
    )
    config = AutoConfig.for_model(family, **family_config(family, params))
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
        if family in RELEASED_TRANSPOSED:
            from .released import transpose_in_place

            transpose_in_place(tmp, RELEASED_TRANSPOSED[family])
        if quant is not None:
            from ..formats.quant import QuantFormat
            from .quantize import quantize_checkpoint

            skips = quant_skips(family, layers, quant)
            quantize_checkpoint(tmp, model, QuantFormat(quant), modules_to_not_convert=skips)
        tokenizer.save_pretrained(tmp)
        record = {
            "family": family,
            "layers": layers,
            "experts": experts,
            "top_k": top_k,
            "hidden": hidden,
            "heads": attn.heads,
            "kv_heads": attn.kv_heads,
            "head_dim": attn.head_dim,
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
