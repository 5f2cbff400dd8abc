"""Quantized checkpoints as a config and headers see them: the format (`QuantFormat`), the config.json
`quantization_config` it is read from and written as (`QuantSpec`, `spec_from_config`), the check of a
checkpoint's quantized tensors from their headers (`check_headers`), and one tensor kept in its stored
encoding (`QuantTensor`). The encodings' arithmetic (quantize, dequantize, the per-tensor checks) is
quant_codecs.py's.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from ..errors import CheckpointError
from .quant_codecs import FP8_DTYPE, MXFP4_GROUP, SCALE_SUFFIX, check_fp8, check_mxfp4, dequantize_fp8, dequantize_mxfp4

__all__ = ["QuantFormat", "QuantSpec", "QuantTensor", "spec_from_config", "check_headers", "STORED_DTYPES"]

# Safetensors dtype names of the tensors these formats store.
STORED_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F32": torch.float32,
                 "BF16": torch.bfloat16, "F16": torch.float16, "U8": torch.uint8, "I8": torch.int8}
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


def check_headers(spec: QuantSpec, headers: Mapping[str, tuple[Any, str, tuple[int, ...]]]) -> None:
    """Check every quantized tensor of a checkpoint from its headers (`model/checkpoint.read_headers`: key ->
    (file, safetensors dtype, shape)): FP8 weights have matching scales, no scale lacks its weight, MXFP4
    blocks have 16-byte groups and matching scales. Raises CheckpointError naming the first bad tensor."""
    def dtype(key):
        st = headers[key][1]
        return STORED_DTYPES.get(st, st)

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

