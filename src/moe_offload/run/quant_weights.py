"""Quantized weights in a loaded model: held as stored in their tier, dequantized on the compute device at use.

A checkpoint's FP8 / MXFP4 tensors (quant.py) keep their stored bytes in every tier. The model's parameter holds
the values as stored (float8_e4m3fn, the in-memory shape; MXFP4: the uint8 blocks [E, rows, G, 16]) and a buffer
beside it holds the scales (`<name>_scale_inv` float32 blocks, `<name>_scales` e8m0 bytes), always in the same
tier: the same host slab, and for an expert tensor split between tiers the same split, so an expert's scale rows
move with it. What crosses the link is those bytes, scales included. No dequantized copy exists in any tier.

Two readers dequantize, each right before the weights are used, into reused device buffers:

- routed experts: the experts function gathers the selected experts' values and scales like any expert tensor
  (experts.py: from the resident stack, or over the link), then `Dequantizer.selected_experts` dequantizes
  exactly those U experts into a [U, ...] buffer in the compute dtype; the class's eager forward then runs on it.
- an nn.Linear with a quantized weight (FP8 attention, dense MLPs, shared experts): a forward pre-hook
  dequantizes the weight from wherever it is at that moment (resident, a uva view of host memory, or the
  prefetch ring's staged copy) into a buffer shared by every Linear of that shape; a post-hook puts the stored
  weight back. Per use, also when resident, rather than once at load: the device then holds exactly the plan's
  (quantized) bytes plus one buffer per distinct weight shape, so --device-memory plans stay true.

The arithmetic is quant.py's, bit-identical to transformers' `dequantize=True` load path, and the eager
forward sees the same values, so outputs equal that reference.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn as nn

from ..errors import CheckpointError
from ..formats.quant import STORED_DTYPES, QuantFormat, QuantSpec, QuantTensor
from ..formats.quant_codecs import SCALE_SUFFIX, check_fp8, check_mxfp4, dequantize_fp8, fp4_lut, fp8_scale_shape
from ..storage.host import ExpertSplit, StagedParameters, byte_view, set_tensor

MXFP4_SCALES, MXFP4_BLOCKS = "_scales", "_blocks"


class Reader(str, enum.Enum):
    """What reads a quantized tensor, and so where it is dequantized."""

    LINEAR = "linear"     # an nn.Linear weight: dequantized whole, per call
    EXPERTS = "experts"   # a fused routed-expert tensor [E, ...]: only the selected experts, per step


@dataclass(frozen=True)
class QuantLayout:
    """How one in-memory tensor is held: values as stored (the parameter) and its scales (a buffer beside it)."""

    name: str                        # in-memory name of the tensor (the parameter)
    format: QuantFormat
    reader: Reader
    shape: tuple[int, ...]           # what it dequantizes to: the in-memory shape transformers holds
    compute_dtype: torch.dtype       # ... and in which dtype (the model's own for that tensor)
    data_shape: tuple[int, ...]      # values as stored
    data_dtype: torch.dtype
    scale_name: str                  # in-memory name of the scales buffer
    scale_shape: tuple[int, ...]
    scale_dtype: torch.dtype
    block: tuple[int, int] | None = None   # FP8 (rows, cols) block
    parts: int = 1                   # FP8: checkpoint matrices fused along rows (gate_up_proj: 2)

    @property
    def local(self) -> str:
        return self.name.rpartition(".")[2]

    @property
    def scale_local(self) -> str:
        return self.scale_name.rpartition(".")[2]

    @property
    def nbytes(self) -> int:
        """Bytes as stored, values and scales: what the plan counts and the link moves."""
        return (math.prod(self.data_shape) * self.data_dtype.itemsize
                + math.prod(self.scale_shape) * self.scale_dtype.itemsize)


def scale_name(name: str, fmt: QuantFormat) -> str:
    """The in-memory name of the scales of tensor `name` (as transformers' quantized modules name them)."""
    return name + (SCALE_SUFFIX if fmt is QuantFormat.FP8 else MXFP4_SCALES)


def checkpoint_owner(key: str, spec: QuantSpec | None) -> tuple[str, bool]:
    """(the checkpoint key of the tensor whose values or scales `key` holds, whether `key` holds scales).

    FP8: `x.weight_scale_inv` -> (`x.weight`, True). MXFP4: `e.down_proj_blocks` -> (`e.down_proj`, False),
    `e.down_proj_scales` -> (`e.down_proj`, True). Anything else is its own owner."""
    if spec is None:
        return key, False
    if spec.format is QuantFormat.FP8:
        return (key.removesuffix(SCALE_SUFFIX), True) if key.endswith(SCALE_SUFFIX) else (key, False)
    for suffix, is_scale in ((MXFP4_BLOCKS, False), (MXFP4_SCALES, True)):
        if key.endswith(suffix):
            return key.removesuffix(suffix), is_scale
    return key, False


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _reader(model: nn.Module, target: str, key: str, fmt: QuantFormat) -> Reader:
    from .experts import is_experts_module

    owner, _, leaf = target.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    if fmt is QuantFormat.FP8 and isinstance(module, nn.Linear) and leaf == "weight":
        return Reader.LINEAR
    param = module._parameters.get(leaf)
    if is_experts_module(module) and param is not None and param.dim() == 3:
        return Reader.EXPERTS
    raise CheckpointError(f"{key} is stored as {fmt.value}, but {target} is read by {type(module).__name__}, which "
                          f"moe-offload cannot dequantize at use (it dequantizes nn.Linear weights and fused "
                          f"routed-expert tensors); list that module in quantization_config.modules_to_not_convert "
                          "and store it unquantized")


def quant_layouts(model: nn.Module, spec: QuantSpec, headers: Mapping[str, tuple], slots: Mapping,
                  shapes: Mapping[str, tuple[int, ...]]) -> dict[str, QuantLayout]:
    """in-memory name -> QuantLayout for every tensor the checkpoint stores quantized.

    headers: checkpoint key -> (file, safetensors dtype, shape) (checkpoint.read_headers, already checked by
    quant.check_headers); slots: owner key (`checkpoint_owner`) -> layouts.Slot; shapes: in-memory name -> shape
    (the plan's). Raises CheckpointError naming the tensor for anything this cannot hold as stored."""
    def dtype(key):
        st = headers[key][1]
        return STORED_DTYPES.get(st, st)

    pieces: dict[str, list[str]] = {}   # target -> checkpoint keys of its quantized values
    plain: dict[str, list[str]] = {}    # target -> checkpoint keys of its unquantized values
    for key in sorted(headers):
        owner, is_scale = checkpoint_owner(key, spec)
        if is_scale:
            values = owner if spec.format is QuantFormat.FP8 else owner + MXFP4_BLOCKS
            if values not in headers:
                raise CheckpointError(f"{key} holds scales, but the checkpoint has no {values}; the checkpoint is "
                                      "incomplete or its tensors were renamed")
            if spec.format is QuantFormat.FP8 and dtype(values) != torch.float8_e4m3fn:
                raise CheckpointError(f"{key} holds block scales, but {values} is stored as "
                                      f"{_name(dtype(values))}, not float8_e4m3fn; scales "
                                      "belong beside a quantized weight: the checkpoint is inconsistent")
            continue
        quantized = key.endswith(MXFP4_BLOCKS) if spec.format is QuantFormat.MXFP4 else \
            dtype(key) == torch.float8_e4m3fn
        (pieces if quantized else plain).setdefault(slots[owner].target, []).append(key)
    out: dict[str, QuantLayout] = {}
    for target, keys in pieces.items():
        if target in plain:   # values are copied as stored, never converted: one encoding per tensor
            other = plain[target][0]
            raise CheckpointError(f"{other} is stored unquantized ({_name(dtype(other))}) but {keys[0]}, another "
                                  f"part of {target}, is {spec.format.value}; a tensor must be quantized whole: the "
                                  "checkpoint is inconsistent")
        if target not in shapes:
            raise CheckpointError(f"{keys[0]} matches no tensor of the model; the checkpoint and config.json are "
                                  "for different models")
        reader = _reader(model, target, keys[0], spec.format)
        compute = model.get_parameter(target).dtype
        shape = tuple(shapes[target])
        if spec.format is QuantFormat.MXFP4:
            key = keys[0]
            owner = key.removesuffix(MXFP4_BLOCKS)
            slot = slots[owner]
            scales = owner + MXFP4_SCALES
            if not slot.is_whole or slot.transpose is not None:
                raise CheckpointError(f"{key} is converted into {target} by expert or with a transpose; MXFP4 is "
                                      "held as stored, so its blocks must be one fused [experts, rows, groups, 16] "
                                      "tensor as gpt-oss ships them")
            present = scales in headers
            check_mxfp4(owner, headers[key][2], dtype(key), headers[scales][2] if present else None,
                        dtype(scales) if present else None, memory_shape=shape)
            out[target] = QuantLayout(target, QuantFormat.MXFP4, reader, shape, compute, tuple(headers[key][2]),
                                      torch.uint8, scale_name(target, QuantFormat.MXFP4),
                                      tuple(headers[scales][2]), torch.uint8)
            continue
        for k in keys:
            slot = slots[k]
            present = k + SCALE_SUFFIX in headers
            check_fp8(k, headers[k][2], dtype(k), headers[k + SCALE_SUFFIX][2] if present else None,
                      dtype(k + SCALE_SUFFIX) if present else None, spec.block)
            if slot.transpose is not None or (slot.parts > 1 and slot.part_dim != 0):
                raise CheckpointError(f"{k} goes into {target} transposed or concatenated along columns; block "
                                      "scales are held as stored only for row-wise layouts (per-expert matrices, "
                                      "gate and up stacked by rows); convert the checkpoint first")
        parts = {slots[k].parts for k in keys}
        scale_dtypes = {dtype(k + SCALE_SUFFIX) for k in keys}
        if len(parts) != 1 or len(scale_dtypes) != 1:
            raise CheckpointError(f"{target} is assembled from FP8 checkpoint tensors with different layouts or "
                                  f"scale dtypes ({sorted(map(_name, scale_dtypes))}); the checkpoint is inconsistent")
        (p,), (sdt,) = parts, scale_dtypes
        out[target] = QuantLayout(target, QuantFormat.FP8, reader, shape, compute, shape, torch.float8_e4m3fn,
                                  scale_name(target, QuantFormat.FP8), fp8_scale_shape(shape, spec.block, p), sdt,
                                  spec.block, p)
    return out


def by_module(layouts: Mapping[str, QuantLayout]) -> dict[str, dict[str, QuantLayout]]:
    """module name -> {local tensor name -> layout}."""
    out: dict[str, dict[str, QuantLayout]] = {}
    for name, q in layouts.items():
        out.setdefault(name.rpartition(".")[0], {})[q.local] = q
    return out


def byte_split(split: ExpertSplit) -> ExpertSplit:
    """The same split with a float8 resident stack seen as its bytes (as `byte_view`)."""
    resident = byte_view(split.resident)
    return split if resident is split.resident else dataclasses.replace(split, resident=resident)


class Dequantizer:
    """Reused output buffers and FP4 tables of one runtime; the two readers' dequantization steps."""

    def __init__(self, device: torch.device, layouts: Mapping[str, QuantLayout]):
        self.device = device
        self.layouts = dict(layouts)
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._luts: dict[tuple, torch.Tensor] = {}
        self.staged_params = StagedParameters()   # the dequantized Linear weights' Parameters, rebound per call

    @property
    def mechanism(self) -> str:
        """What the runtime report adds: where and when quantized weights become the compute dtype."""
        formats = "/".join(sorted({q.format.value for q in self.layouts.values()}))
        readers = {q.reader for q in self.layouts.values()}
        what = ["selected experts per step"] * (Reader.EXPERTS in readers) + \
            ["Linear weights per call, resident ones too"] * (Reader.LINEAR in readers)
        return (f"; {formats} weights held as stored in every tier (scales beside them), dequantized on "
                f"{self.device} into reused buffers: {', '.join(what)}")

    def _buffer(self, key: tuple, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        need = math.prod(shape)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < need:
            buf = torch.empty(need, dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf[:need].view(shape)

    def _lut(self, dtype: torch.dtype, device) -> torch.Tensor:
        key = (dtype, str(device))
        if key not in self._luts:
            self._luts[key] = fp4_lut(dtype, device)
        return self._luts[key]

    def buffers(self) -> list[torch.Tensor]:
        """The reused device buffers quantized weights are dequantized into (what dequantizing costs in memory)."""
        return list(self._buffers.values())

    # --- routed experts -------------------------------------------------------------------------------------
    def selected_experts(self, module: nn.Module, layouts: Mapping[str, QuantLayout],
                         staged: dict[str, torch.Tensor], selected: torch.Tensor) -> None:
        """Replace, in `staged` (local name -> gathered rows [U, ...] of the `selected` experts, ascending), the
        stored values of each quantized tensor by those experts dequantized into a reused buffer, and drop the
        gathered scales. A tensor with nothing gathered (resident whole) has its rows taken here, on the device."""
        n = selected.numel()
        for local, q in layouts.items():
            data = staged.get(local)   # gathered as bytes (byte_view) when float8
            if data is None:
                data = byte_view(getattr(module, local)).index_select(0, selected)
            data = data.view(q.data_dtype)
            scale = staged.pop(q.scale_local, None)
            if scale is None:
                scale = getattr(module, q.scale_local).index_select(0, selected)
            out = self._buffer(("experts", local, q.shape[1:], q.compute_dtype), (n, *q.shape[1:]),
                               q.compute_dtype, data.device)
            lut = self._lut(q.compute_dtype, data.device) if q.format is QuantFormat.MXFP4 else None
            QuantTensor(q.format, data, scale, q.block, q.parts).dequantize(dtype=q.compute_dtype, out=out, lut=lut)
            staged[local] = out

    @staticmethod
    def stored_experts(module: nn.Module, layouts: Mapping[str, QuantLayout], staged: dict[str, torch.Tensor],
                       selected: torch.Tensor) -> None:
        """For kernels that read the stored format (run/fused.py): complete `staged` with the `selected` experts'
        values (as bytes when float8) and scales of each quantized tensor nothing was gathered for (resident
        whole), a device-local gather; nothing is dequantized."""
        for local, q in layouts.items():
            if local not in staged:
                staged[local] = byte_view(getattr(module, local)).index_select(0, selected)
            if q.scale_local not in staged:
                staged[q.scale_local] = getattr(module, q.scale_local).index_select(0, selected)

    # --- Linear weights -------------------------------------------------------------------------------------
    def hook_linears(self, model: nn.Module, handles: list, served=frozenset()) -> None:
        """Pre/post hooks on every nn.Linear whose weight is quantized, but those `served` (read as stored by the
        CPU kernel: dense_kernel.py). The pre-hook runs after any hook already registered (the dense prefetch ring
        stages first), the post-hook before them (prepend): they nest."""
        for name, q in self.layouts.items():
            if q.reader is not Reader.LINEAR or name in served:
                continue
            module = model.get_submodule(name.rpartition(".")[0])
            # `home`: the stored weight as loaded. `during`: the one the current call dequantized (the prefetch
            # ring may have swapped in its staged copy), put back by the post-hook.
            home = module._parameters["weight"]
            during = [home]

            def pre(m, args, q=q, home=home, during=during):
                weight, scale = m._parameters["weight"], m._buffers[q.scale_local]
                if weight.dtype != q.data_dtype:   # a call that raised left the dequantized weight in place
                    weight = home
                out = self._buffer(("linear", q.shape, q.compute_dtype), q.shape, q.compute_dtype, weight.device)
                dequantize_fp8(weight, scale, q.block, dtype=q.compute_dtype, out=out)
                during[0] = weight
                self.staged_params.put(m, "weight", out)

            def post(m, args, output, during=during):
                set_tensor(m, "weight", during[0])

            handles.append(module.register_forward_pre_hook(pre))
            handles.append(module.register_forward_hook(post, prepend=True))
