"""Quantized weight encodings as data and arithmetic: FP8 e4m3 with block scales, MXFP4 experts.

The two formats real MoE checkpoints ship:

- **FP8** (DeepSeek-V3/R1, Kimi-K2, Qwen3-FP8): a Linear (or per-expert) weight [rows, cols] is stored as
  `float8_e4m3fn` with `<name>_scale_inv` float32 [ceil(rows/bm), ceil(cols/bn)]: block (i, j) of the
  weight reads `q * scale_inv[i, j]`. `(bm, bn)` is the config's `quantization_config.weight_block_size`.
- **MXFP4** (gpt-oss): a fused expert tensor is stored as `<name>_blocks` uint8 [E, rows, G, 16] (two FP4
  e2m1 codes per byte, low nibble first: 32 values per group) and `<name>_scales` uint8 [E, rows, G]
  (e8m0: the group reads `code * 2**(byte - 127)`), rows being the output features. transformers holds
  gpt-oss experts transposed ([E, in, out]), so dequantizing yields [E, G*32, rows].

Dequantization is bit-identical to transformers' `dequantize=True` load path (same dtypes, same order:
FP8 `(q.float() * s.float()).to(dtype)`; MXFP4 a table lookup in `dtype`, then `ldexp`), device-agnostic
(plain torch ops run where the tensors are), and works on a subset of experts into a caller's buffer, so
the runtime can dequantize just the experts a step selected into reused memory.

One difference from transformers is deliberate: its dequantizing loader derives the FP8 block from the
scale grid (`rows // scale_rows`), so a partial last block is refused or misread (DeepSeek-V3's
`kv_a_proj_with_mqa`, 576 rows in 5 scale rows of 128, is refused; 192 rows in 2 would read as blocks of
96). Here the block is the config's, as in transformers' FP8Linear and DeepSeek's reference kernel; the
two agree whenever the blocks tile the weight exactly, as in every make-tiny checkpoint.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from ..errors import CheckpointError

__all__ = ["QuantFormat", "QuantSpec", "QuantTensor", "spec_from_config", "FP8_MAX", "FP4_VALUES",
           "MXFP4_GROUP", "fp8_scale_shape", "quantize_fp8", "dequantize_fp8", "check_fp8", "fp4_lut",
           "quantize_mxfp4", "dequantize_mxfp4", "check_mxfp4", "check_headers", "SCALE_SUFFIX",
           "quantize_checkpoint"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448: e4m3fn has no infinities
SCALE_SUFFIX = "_scale_inv"                   # `x.weight` -> `x.weight_scale_inv`
MXFP4_GROUP = 32                              # values sharing one e8m0 scale
_E8M0_BIAS = 127
# The e2m1 value of each 4-bit code (sign bit 3): the table transformers and gpt-oss use.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_FP4_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # between consecutive magnitudes 0 .. 6
# Safetensors dtype names of the tensors these formats store.
_ST = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F32": torch.float32, "BF16": torch.bfloat16,
       "F16": torch.float16, "U8": torch.uint8, "I8": torch.int8}
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FP8_FMTS = {"e4m3": FP8_DTYPE}


class QuantFormat(enum.Enum):
    FP8 = "fp8"      # float8_e4m3fn + block scales
    MXFP4 = "mxfp4"  # e2m1 codes + one e8m0 scale per 32 values


@dataclass(frozen=True)
class QuantSpec:
    """A checkpoint's `quantization_config`, as far as the stored bytes depend on it."""

    format: QuantFormat
    block: tuple[int, int] | None = None                   # FP8 (bm, bn); None for MXFP4
    modules_to_not_convert: tuple[str, ...] | None = None  # None: absent from the config

    def to_config(self) -> dict[str, Any]:
        """The `quantization_config` entry of config.json, in the shape the released models use."""
        if self.format is QuantFormat.FP8:
            qc: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(self.block)}
        else:
            qc = {"quant_method": "mxfp4"}
        if self.modules_to_not_convert is not None:
            qc["modules_to_not_convert"] = list(self.modules_to_not_convert)
        return qc


def spec_from_config(config) -> QuantSpec | None:
    """The spec of a transformers config (or a config.json dict); None when it is not quantized."""
    if isinstance(config, Mapping):
        qc = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    else:
        qc = getattr(config, "quantization_config", None) or getattr(
            getattr(config, "text_config", None), "quantization_config", None)
    if qc is None:
        return None
    qc = dict(qc) if isinstance(qc, Mapping) else qc.to_dict()
    method = qc.get("quant_method")
    skip = qc.get("modules_to_not_convert")
    skip = tuple(skip) if skip is not None else None
    where = "config.json quantization_config"
    if method == "mxfp4":
        return QuantSpec(QuantFormat.MXFP4, None, skip)
    if method != "fp8":
        raise CheckpointError(f"{where} has quant_method {method!r}: moe-offload reads 'fp8' (block-scaled e4m3) "
                              "and 'mxfp4' checkpoints only; use an fp8/mxfp4 or unquantized checkpoint")
    fmt = qc.get("fmt", "e4m3")
    if fmt not in _FP8_FMTS:
        raise CheckpointError(f"{where} has fmt {fmt!r}: only {sorted(_FP8_FMTS)} FP8 weights are supported; "
                              "the checkpoint uses another float8 layout, convert it to e4m3")
    if qc.get("scale_fmt", "float") != "float" or qc.get("activation_scheme", "dynamic") != "dynamic":
        raise CheckpointError(f"{where} has scale_fmt {qc.get('scale_fmt')!r} / activation_scheme "
                              f"{qc.get('activation_scheme')!r}: only float block scales with dynamic activations "
                              "(DeepSeek-V3 style) are supported")
    block = qc.get("weight_block_size", (128, 128))  # absent: transformers' FineGrainedFP8Config default
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise CheckpointError(f"{where} has weight_block_size {block!r}: it must be two positive ints such as "
                              "[128, 128] (per-tensor FP8 scales are not supported)")
    return QuantSpec(QuantFormat.FP8, (block[0], block[1]), skip)


def _index(t: torch.Tensor, experts) -> torch.Tensor:
    if experts is None:
        return t
    if not isinstance(experts, torch.Tensor):
        experts = torch.as_tensor(list(experts), dtype=torch.long)
    return t.index_select(0, experts.to(device=t.device, dtype=torch.long))


def _output(out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != shape or out.dtype != dtype:
        raise ValueError(f"output buffer is {list(out.shape)} {out.dtype}, the dequantized tensor is "
                         f"{list(shape)} {dtype}")
    return out


# ---------------------------------------------------------------------------------------
# FP8 e4m3, block-scaled


def fp8_scale_shape(shape: Sequence[int], block: tuple[int, int], parts: int = 1) -> tuple[int, ...]:
    """Shape of the scales of an FP8 weight of `shape` [..., rows, cols]. `parts`: a fused tensor made of
    `parts` checkpoint matrices stacked along rows (gate_up_proj: 2), each with its own block grid."""
    *lead, rows, cols = shape
    return (*lead, parts * math.ceil(rows // parts / block[0]), math.ceil(cols / block[1]))


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv) of `weight` [..., rows, cols]: each block is divided by
    amax/448 (DeepSeek's recipe), so its largest value lands on the format's largest. Partial last blocks
    are allowed."""
    bm, bn = block
    *lead, rows, cols = weight.shape
    gr, gc = math.ceil(rows / bm), math.ceil(cols / bn)
    w = torch.nn.functional.pad(weight.to(torch.float32), (0, gc * bn - cols, 0, gr * bm - rows))
    tiles = w.reshape(*lead, gr, bm, gc, bn)  # padding zeros never raise a block's amax
    amax = tiles.abs().amax(dim=(-3, -1))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (tiles / scale_inv[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(*lead, gr * bm, gc * bn)[..., :rows, :cols].contiguous(), scale_inv


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], *,
                   dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None, experts=None,
                   parts: int = 1) -> torch.Tensor:
    """`weight * scale_inv` per block, computed in float32 and rounded once to `dtype`.

    weight [E?, rows, cols] fp8, scale_inv as `fp8_scale_shape`; `experts` (ids along dim 0) selects a
    subset, written in that order into `out` [len(experts), rows, cols] when given."""
    weight, scale = _index(weight, experts), _index(scale_inv, experts)
    *lead, rows, cols = weight.shape
    result = _output(out, tuple(weight.shape), dtype, weight.device)
    bm, bn = block
    part_rows, part_scale_rows = rows // parts, scale.shape[-2] // parts
    # Expand the scales over rows only (small: rows x cols/bn); columns are broadcast through a view.
    s = scale.to(torch.float32).unflatten(-2, (parts, part_scale_rows))
    s = s.repeat_interleave(bm, dim=-2)[..., :part_rows, :].flatten(-3, -2)       # [..., rows, gc]
    work = result if dtype == torch.float32 else torch.empty(weight.shape, dtype=torch.float32,
                                                               device=weight.device)
    work.copy_(weight)  # fp8 -> float32 is exact
    full = cols // bn
    work[..., : full * bn].unflatten(-1, (full, bn)).mul_(s[..., :full, None])
    if cols % bn:
        work[..., full * bn:].mul_(s[..., full:])
    if work is not result:
        result.copy_(work)
    return result


def check_fp8(name: str, weight_shape: Sequence[int], weight_dtype: torch.dtype,
              scale_shape: Sequence[int] | None, scale_dtype: torch.dtype | None, block: tuple[int, int],
              parts: int = 1) -> None:
    """Raise CheckpointError unless `name` is an e4m3 weight whose scales match its block grid."""
    scale_name = name + SCALE_SUFFIX
    if weight_dtype != FP8_DTYPE:
        raise CheckpointError(f"{name} is stored as {str(weight_dtype).removeprefix('torch.')} but the config's "
                              "fmt is e4m3 (float8_e4m3fn); the checkpoint and its quantization_config disagree, "
                              "use the config the checkpoint was exported with")
    if scale_shape is None:
        raise CheckpointError(f"{name} is float8_e4m3fn but the checkpoint has no {scale_name}: FP8 values cannot "
                              "be read without their block scales; the checkpoint is incomplete, copy it again")
    if len(weight_shape) < 2:
        raise CheckpointError(f"{name} is a {len(weight_shape)}-d FP8 tensor {list(weight_shape)}; block-scaled "
                              "FP8 stores matrices only")
    need = fp8_scale_shape(weight_shape, block, parts)
    if tuple(scale_shape) != need:
        raise CheckpointError(
            f"{scale_name} has shape {list(scale_shape)} but {name} {list(weight_shape)} in blocks of "
            f"{list(block)} needs {list(need)}; the scales belong to another tensor or block size, check "
            "weight_block_size in config.json")
    if scale_dtype not in _SCALE_DTYPES:
        raise CheckpointError(f"{scale_name} is {str(scale_dtype).removeprefix('torch.')}: block scales must be "
                              "float32, bfloat16 or float16 (e8m0 scales are not supported)")


# ---------------------------------------------------------------------------------------
# MXFP4 (gpt-oss experts)


def fp4_lut(dtype: torch.dtype, device=None) -> torch.Tensor:
    """The e2m1 code -> value table in `dtype` on `device` (callers on a hot path keep one)."""
    return torch.tensor(FP4_VALUES, dtype=dtype, device=device)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks uint8 [..., rows, G, 16], scales uint8 [..., rows, G]) of `weight` [..., rows, cols] in the
    stored orientation (rows = output features; gpt-oss's in-memory [E, in, out] transposed).

    Each group of 32 gets the smallest power-of-two scale that brings its largest magnitude to at most 6
    (so nothing saturates), and values round to the nearest e2m1 value, ties to the even code."""
    *lead, rows, cols = weight.shape
    if cols % MXFP4_GROUP:
        raise ValueError(f"MXFP4 groups {MXFP4_GROUP} values along the input dimension; {cols} is not a multiple")
    w = weight.to(torch.float32).contiguous().reshape(*lead, rows, cols // MXFP4_GROUP, MXFP4_GROUP)
    amax = w.abs().amax(dim=-1)
    # frexp: amax = m * 2**p, m in [0.5, 1), so 2**(p-3) <= amax/4 < 2**(p-2): the candidate exponent p-3
    # leaves amax/2**e in [4, 8), one more halves it into [2, 4).
    _, p = torch.frexp(amax)
    e = p.to(torch.int32) - 3
    e = torch.where(amax > torch.ldexp(torch.full_like(amax, 6.0), e), e + 1, e)
    e = torch.where(amax > 0, e, torch.zeros_like(e)).clamp(-_E8M0_BIAS, _E8M0_BIAS)
    mag = torch.ldexp(w.abs(), -e[..., None])  # exact: a power-of-two rescale
    mids = torch.tensor(_FP4_MIDPOINTS, dtype=torch.float32, device=w.device)
    down, up = torch.bucketize(mag, mids), torch.bucketize(mag, mids, right=True)
    code = torch.where(down % 2 == 0, down, up)  # differ only on a tie: keep the even code
    code = (code + 8 * (w < 0)).to(torch.uint8)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks.contiguous(), (e + _E8M0_BIAS).to(torch.uint8)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, *, dtype: torch.dtype = torch.bfloat16,
                     out: torch.Tensor | None = None, experts=None, lut: torch.Tensor | None = None) -> torch.Tensor:
    """Values of blocks [E, rows, G, 16] / scales [E, rows, G], transposed as transformers holds them:
    [E or len(experts), G*32, rows]. `lut`: a `fp4_lut(dtype, device)` to reuse."""
    blocks, scales = _index(blocks, experts), _index(scales, experts)
    n, rows, groups, _ = blocks.shape
    result = _output(out, (n, groups * MXFP4_GROUP, rows), dtype, blocks.device)
    lut = fp4_lut(dtype, blocks.device) if lut is None else lut
    # Write through the transposed view: the same elementwise ops as transformers, no second copy.
    values = result.transpose(-1, -2).unflatten(-1, (groups, MXFP4_GROUP))  # [n, rows, G, 32]
    values[..., 0::2] = lut[(blocks & 0x0F).to(torch.int)]
    values[..., 1::2] = lut[(blocks >> 4).to(torch.int)]
    values.ldexp_((scales.to(torch.int32) - _E8M0_BIAS)[..., None])
    return result


def check_mxfp4(name: str, blocks_shape: Sequence[int], blocks_dtype: torch.dtype,
                scales_shape: Sequence[int] | None, scales_dtype: torch.dtype | None,
                memory_shape: Sequence[int] | None = None) -> None:
    """Raise CheckpointError unless `name`_blocks/_scales are well-formed MXFP4 (and, given the in-memory
    [E, in, out] `memory_shape`, hold exactly that tensor)."""
    b, s = f"{name}_blocks", f"{name}_scales"
    if blocks_dtype != torch.uint8:
        raise CheckpointError(f"{b} is {str(blocks_dtype).removeprefix('torch.')}: MXFP4 blocks are uint8 (two "
                              "FP4 codes a byte); the checkpoint is not gpt-oss MXFP4")
    if len(blocks_shape) != 4 or blocks_shape[-1] != MXFP4_GROUP // 2:
        raise CheckpointError(f"{b} has shape {list(blocks_shape)}: MXFP4 blocks are [experts, rows, groups, "
                              f"{MXFP4_GROUP // 2}] ({MXFP4_GROUP} values of 4 bits per group); the file is not "
                              "gpt-oss MXFP4 or was reshaped")
    if scales_shape is None:
        raise CheckpointError(f"{b} has no {s}: MXFP4 values cannot be read without their e8m0 scales; the "
                              "checkpoint is incomplete, copy it again")
    if tuple(scales_shape) != tuple(blocks_shape[:-1]) or scales_dtype != torch.uint8:
        raise CheckpointError(f"{s} is {list(scales_shape)} {str(scales_dtype).removeprefix('torch.')} but {b} "
                              f"{list(blocks_shape)} needs uint8 {list(blocks_shape[:-1])} (one scale per group)")
    if memory_shape is not None:
        e, rows, groups, _ = blocks_shape
        holds = (e, groups * MXFP4_GROUP, rows)
        if holds != tuple(memory_shape):
            raise CheckpointError(f"{b} {list(blocks_shape)} holds a [{e}, {holds[1]}, {rows}] tensor but the model's "
                                  f"{name} is {list(memory_shape)}; the checkpoint and config.json are for "
                                  "different models")


def check_headers(spec: QuantSpec, headers: Mapping[str, tuple[Any, str, tuple[int, ...]]]) -> None:
    """Check every quantized tensor of a checkpoint from its headers (`inventory.read_headers`: key ->
    (file, safetensors dtype, shape)): FP8 weights have matching scales, no scale lacks its weight, MXFP4
    blocks have 16-byte groups and matching scales. Raises CheckpointError naming the first bad tensor."""
    def dtype(key):
        st = headers[key][1]
        return _ST.get(st, st)

    for key in sorted(headers):
        shape = tuple(headers[key][2])
        if spec.format is QuantFormat.FP8:
            if key.endswith(SCALE_SUFFIX) and key.removesuffix(SCALE_SUFFIX) not in headers:
                raise CheckpointError(f"{key} has no weight {key.removesuffix(SCALE_SUFFIX)} in the checkpoint; "
                                      "the checkpoint is incomplete or its tensors were renamed")
            if dtype(key) in (torch.float8_e4m3fn, torch.float8_e5m2):
                scale = key + SCALE_SUFFIX
                present = scale in headers
                check_fp8(key, shape, dtype(key), headers[scale][2] if present else None,
                          dtype(scale) if present else None, spec.block)
        else:
            if key.endswith("_scales") and key.removesuffix("_scales") + "_blocks" not in headers:
                raise CheckpointError(f"{key} has no {key.removesuffix('_scales')}_blocks in the checkpoint; "
                                      "the checkpoint is incomplete or its tensors were renamed")
            if key.endswith("_blocks"):
                name = key.removesuffix("_blocks")
                scale = name + "_scales"
                present = scale in headers
                check_mxfp4(name, shape, dtype(key), headers[scale][2] if present else None,
                            dtype(scale) if present else None)


# ---------------------------------------------------------------------------------------
# One tensor kept in its stored encoding


@dataclass(frozen=True, eq=False)
class QuantTensor:
    """An in-memory tensor held as stored: FP8 `data` [E?, rows, cols] + `scale` (`parts` matrices fused
    along rows), or MXFP4 blocks [E, rows, G, 16] + scales. `shape` is what it dequantizes to."""

    format: QuantFormat
    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int] | None = None
    parts: int = 1

    @property
    def shape(self) -> tuple[int, ...]:
        if self.format is QuantFormat.FP8:
            return tuple(self.data.shape)
        e, rows, groups, _ = self.data.shape
        return (e, groups * MXFP4_GROUP, rows)

    @property
    def nbytes(self) -> int:
        """Bytes as stored (and moved over the link): values and scales."""
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()

    def dequantize(self, *, dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None,
                   experts=None, lut: torch.Tensor | None = None) -> torch.Tensor:
        if self.format is QuantFormat.FP8:
            return dequantize_fp8(self.data, self.scale, self.block, dtype=dtype, out=out, experts=experts,
                                  parts=self.parts)
        return dequantize_mxfp4(self.data, self.scale, dtype=dtype, out=out, experts=experts, lut=lut)


# ---------------------------------------------------------------------------------------
# Writing quantized checkpoints (make-tiny)


def _largest_block(sizes, cap: int = 128) -> int:
    """The largest power of two <= cap that divides every size."""
    b = cap
    while any(n % b for n in sizes):
        b //= 2
    return b


def quantize_checkpoint(folder, model: torch.nn.Module, fmt: QuantFormat, *,
                        modules_to_not_convert: Sequence[str] | None = None,
                        block: tuple[int, int] | None = None) -> QuantSpec:
    """Rewrite the safetensors files `save_pretrained(model)` wrote in `folder` into `fmt`, as the released
    checkpoints store it, and add the `quantization_config` to its config.json. Returns the spec written.

    FP8: the 2-d weights of the modules transformers' FP8 integration converts (every `nn.Linear` and
    per-expert matrix outside `modules_to_not_convert`, whose default keeps the LM head) become e4m3 +
    `weight_scale_inv`; `block` None picks the largest power-of-two block up to 128x128 that tiles all of
    them exactly. MXFP4: the fused `experts.gate_up_proj` / `down_proj` become `_blocks` + `_scales`;
    biases and everything else stay as they were."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    from .layouts import map_keys

    folder = Path(folder)
    skip = list(modules_to_not_convert) if modules_to_not_convert is not None else get_keys_to_not_convert(model)
    skip += list(getattr(model, "_keep_in_fp32_modules", None) or ())  # as transformers' quantizers add them
    convert = {name for name, m in model.named_modules()
               if (type(m) is torch.nn.Linear or name.endswith(".experts")) and should_convert_module(name, skip)}
    files = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            files[path] = ({k: f.get_tensor(k) for k in f.keys()}, f.metadata())

    # Checkpoint names are not always the in-memory ones (Mixtral's `block_sparse_moe.experts.3.w1`):
    # decide by the in-memory tensor each key lands in.
    slots = map_keys(model, [k for state, _ in files.values() for k in state])

    def fp8_target(key: str, t: torch.Tensor) -> bool:
        return (key.endswith(".weight") and t.ndim == 2 and t.is_floating_point()
                and slots[key].target.rpartition(".")[0] in convert)

    def mxfp4_target(key: str, t: torch.Tensor) -> bool:
        module, _, param = slots[key].target.rpartition(".")
        return t.ndim == 3 and slots[key].is_whole and module in convert and param in ("gate_up_proj", "down_proj")

    renamed: dict[str, list[str]] = {}
    if fmt is QuantFormat.FP8:
        targets = [(k, t) for state, _ in files.values() for k, t in state.items() if fp8_target(k, t)]
        if block is None:
            block = (_largest_block([t.shape[0] for _, t in targets]),
                     _largest_block([t.shape[1] for _, t in targets]))
        for state, _ in files.values():
            for key in [k for k, t in state.items() if fp8_target(k, t)]:
                state[key], state[key + SCALE_SUFFIX] = quantize_fp8(state[key], block)
                renamed[key] = [key, key + SCALE_SUFFIX]
    else:
        for state, _ in files.values():
            for key in [k for k, t in state.items() if mxfp4_target(k, t)]:
                # Stored orientation is [E, out, in]; transformers holds gpt-oss experts as [E, in, out].
                blocks, scales = quantize_mxfp4(state.pop(key).transpose(-1, -2))
                state[key + "_blocks"], state[key + "_scales"] = blocks, scales
                renamed[key] = [key + "_blocks", key + "_scales"]
    spec = QuantSpec(fmt, tuple(block) if fmt is QuantFormat.FP8 else None,
                     None if modules_to_not_convert is None else tuple(modules_to_not_convert))
    if not renamed:
        raise ValueError(f"{type(model).__name__} has no tensor that {fmt.value} quantizes")
    for path, (state, metadata) in files.items():
        save_file(state, str(path), metadata=metadata)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        wm = data["weight_map"]
        for old, new in renamed.items():
            shard = wm.pop(old)
            wm.update({k: shard for k in new})
        index.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"] = spec.to_config()
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return spec
