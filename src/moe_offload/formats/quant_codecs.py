"""Quantized weight encodings as arithmetic: FP8 e4m3 with block scales, MXFP4 experts.

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

What a checkpoint's config says about its encoding (`QuantSpec`) and a tensor held as stored (`QuantTensor`)
are quant.py's.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ..errors import CheckpointError

__all__ = ["FP8_DTYPE", "FP8_MAX", "FP4_VALUES", "MXFP4_GROUP", "SCALE_SUFFIX", "fp8_scale_shape", "quantize_fp8",
           "dequantize_fp8", "check_fp8", "fp4_lut", "quantize_mxfp4", "dequantize_mxfp4", "check_mxfp4"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448: e4m3fn has no infinities
SCALE_SUFFIX = "_scale_inv"                   # `x.weight` -> `x.weight_scale_inv`
MXFP4_GROUP = 32                              # values sharing one e8m0 scale
_E8M0_BIAS = 127
# The e2m1 value of each 4-bit code (sign bit 3): the table transformers and gpt-oss use.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_FP4_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # between consecutive magnitudes 0 .. 6
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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
    # Write through the transposed view: the same elementwise ops as transformers, no second copy; one expert at a
    # time, so that the index and lookup temporaries are one expert's (gpt-oss-20b: 250 MB for five experts at once).
    values = result.transpose(-1, -2).unflatten(-1, (groups, MXFP4_GROUP))  # [n, rows, G, 32]
    for e in range(n):
        values[e, ..., 0::2] = lut[(blocks[e] & 0x0F).to(torch.int)]
        values[e, ..., 1::2] = lut[(blocks[e] >> 4).to(torch.int)]
        values[e].ldexp_((scales[e].to(torch.int32) - _E8M0_BIAS)[..., None])
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
