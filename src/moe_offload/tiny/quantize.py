"""make-tiny --quant: a saved checkpoint rewritten in the quantized on-disk format the released models use.

FP8 e4m3 + `weight_scale_inv` block scales (DeepSeek-V3, Qwen3-FP8) or gpt-oss MXFP4 experts (`_blocks` /
`_scales`), with the encodings of formats/quant_codecs.py and the `quantization_config` of formats/quant.py.

The rewrite streams: each shard's new header is planned from the old one's shapes, then every tensor is read,
encoded and written a bounded slice at a time (rows of FP8 blocks, experts of an MXFP4 tensor) into a new file
that replaces the shard, so a released-dimension checkpoint of many GB is quantized in tens of MB of memory. The
files are laid out as `safetensors.torch.save_file` lays them out (stream_save.shard_header).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..formats.layouts import map_keys
from ..formats.quant import QuantFormat, QuantSpec
from ..formats.quant_codecs import (FP8_DTYPE, MXFP4_GROUP, SCALE_SUFFIX, fp8_scale_shape, quantize_fp8,
                                    quantize_mxfp4)
from ..formats.safetensors import parse_header

__all__ = ["quantize_checkpoint"]

_CHUNK = 64 << 20  # bytes of float32 input encoded at a time


def _largest_block(sizes, cap: int = 128) -> int:
    """The largest power of two <= cap that divides every size."""
    b = cap
    while any(n % b for n in sizes):
        b //= 2
    return b


@dataclass(frozen=True)
class _Rewrite:
    """How one stored tensor is written: `outputs` (name -> (dtype, shape)) from its rows `[i, j)` (dim 0) by
    `encode` (None: copied as it is); each call reads at most `step` rows (for FP8 a multiple of the block)."""

    outputs: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    encode: Callable[[torch.Tensor], tuple[torch.Tensor, ...]] | None
    step: int


def _rows_per_step(shape: tuple[int, ...], multiple: int = 1) -> int:
    row = math.prod(shape[1:]) * 4 if len(shape) > 1 else 4
    rows = max(multiple, _CHUNK // max(1, row) // multiple * multiple)
    return rows if shape else 1


def quantize_checkpoint(folder, model: torch.nn.Module, fmt: QuantFormat, *,
                        modules_to_not_convert: Sequence[str] | None = None,
                        block: tuple[int, int] | None = None) -> QuantSpec:
    """Rewrite the safetensors files `save_pretrained(model)` wrote in `folder` into `fmt`, as the released
    checkpoints store it, and add the `quantization_config` to its config.json. Returns the spec written.

    FP8: the 2-d weights of the modules transformers' FP8 integration converts (every `nn.Linear` and
    per-expert matrix outside `modules_to_not_convert`, whose default keeps the LM head) become e4m3 +
    `weight_scale_inv`; `block` None picks the largest power-of-two block up to 128x128 that tiles all of
    them exactly. MXFP4: the fused `experts.gate_up_proj` / `down_proj` become `_blocks` + `_scales`;
    biases and everything else stay as they were. `model` may be on the meta device (only its names and
    modules are read)."""
    from safetensors import safe_open
    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    folder = Path(folder)
    skip = list(modules_to_not_convert) if modules_to_not_convert is not None else get_keys_to_not_convert(model)
    skip += list(getattr(model, "_keep_in_fp32_modules", None) or ())  # as transformers' quantizers add them
    convert = {name for name, m in model.named_modules()
               if (type(m) is torch.nn.Linear or name.endswith(".experts")) and should_convert_module(name, skip)}
    files = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata()
        fd = os.open(path, os.O_RDONLY)
        try:
            files[path] = (parse_header(path, fd, os.fstat(fd).st_size), metadata)
        finally:
            os.close(fd)

    # Checkpoint names are not always the in-memory ones (Mixtral's `block_sparse_moe.experts.3.w1`):
    # decide by the in-memory tensor each key lands in.
    slots = map_keys(model, [k for spans, _ in files.values() for k in spans])

    def fp8_target(key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
        return (key.endswith(".weight") and len(shape) == 2 and dtype.is_floating_point
                and slots[key].target.rpartition(".")[0] in convert)

    def mxfp4_target(key: str, shape: tuple[int, ...]) -> bool:
        module, _, param = slots[key].target.rpartition(".")
        return len(shape) == 3 and slots[key].is_whole and module in convert and param in ("gate_up_proj", "down_proj")

    spans_all = [s for spans, _ in files.values() for s in spans.values()]
    if fmt is QuantFormat.FP8:
        targets = [s for s in spans_all if fp8_target(s.name, s.dtype, s.shape)]
        if block is None:
            block = (_largest_block([s.shape[0] for s in targets]), _largest_block([s.shape[1] for s in targets]))
        block = (int(block[0]), int(block[1]))
    else:
        targets = [s for s in spans_all if mxfp4_target(s.name, s.shape)]
        for s in targets:
            if s.shape[1] % MXFP4_GROUP:
                raise ValueError(f"{s.name} {list(s.shape)}: MXFP4 groups {MXFP4_GROUP} values along each input "
                                 f"dimension, and {s.shape[1]} is not a multiple of {MXFP4_GROUP}")
    if not targets:
        raise ValueError(f"{type(model).__name__} has no tensor that {fmt.value} quantizes")
    target_names = {s.name for s in targets}

    def plan(s) -> _Rewrite:
        if s.name not in target_names:
            return _Rewrite({s.name: (s.dtype, s.shape)}, None, _rows_per_step(s.shape))
        if fmt is QuantFormat.FP8:
            return _Rewrite({s.name: (FP8_DTYPE, s.shape),
                             s.name + SCALE_SUFFIX: (torch.float32, fp8_scale_shape(s.shape, block))},
                            lambda t: quantize_fp8(t, block), _rows_per_step(s.shape, block[0]))
        # Stored orientation is [E, out, in]; transformers holds gpt-oss experts as [E, in, out].
        e, n_in, n_out = s.shape
        groups = n_in // MXFP4_GROUP
        return _Rewrite({s.name + "_blocks": (torch.uint8, (e, n_out, groups, MXFP4_GROUP // 2)),
                         s.name + "_scales": (torch.uint8, (e, n_out, groups))},
                        lambda t: quantize_mxfp4(t.transpose(-1, -2)), _rows_per_step(s.shape))

    renamed: dict[str, list[str]] = {}
    for path, (spans, metadata) in files.items():
        rewrites = {name: plan(s) for name, s in spans.items()}
        _rewrite_file(path, spans, rewrites, metadata)
        renamed.update({name: list(r.outputs) for name, r in rewrites.items() if r.encode is not None})
    spec = QuantSpec(fmt, tuple(block) if fmt is QuantFormat.FP8 else None,
                     None if modules_to_not_convert is None else tuple(modules_to_not_convert))
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


def _pwrite_all(fd: int, t: torch.Tensor, offset: int) -> None:
    view = memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _read_rows(fd: int, span, i: int, j: int) -> torch.Tensor:
    """Rows [i, j) (dim 0) of the stored tensor `span`, read from the open file `fd`."""
    row = math.prod(span.shape[1:]) * span.dtype.itemsize
    want = (j - i) * row if span.shape else span.nbytes
    buf = bytearray(want)
    view, offset = memoryview(buf), span.start + i * row
    while view:
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise OSError(f"{span.name}: the file ends before its data")
        view, offset = view[n:], offset + n
    t = torch.frombuffer(buf, dtype=torch.uint8) if want else torch.empty(0, dtype=torch.uint8)
    return t.view(span.dtype).reshape((j - i, *span.shape[1:]) if span.shape else ())


def _rewrite_file(path: Path, spans: dict, rewrites: dict[str, _Rewrite], metadata) -> None:
    """Write `path` anew with every tensor's `rewrites` outputs, a step of rows at a time, then replace it."""
    from ..formats.stream_save import shard_header

    tensors = {name: spec for r in rewrites.values() for name, spec in r.outputs.items()}
    head, out_spans = shard_header(tensors, metadata)
    tmp = path.with_name(path.name + ".quantizing")
    src = os.open(path, os.O_RDONLY)
    try:
        dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _pwrite_all(dst, torch.frombuffer(bytearray(head), dtype=torch.uint8), 0)
            os.ftruncate(dst, len(head) + max((e for _, e in out_spans.values()), default=0))
            for name, r in rewrites.items():
                span = spans[name]
                rows = span.shape[0] if span.shape else 1
                written = {out: len(head) + out_spans[out][0] for out in r.outputs}
                for i in range(0, max(rows, 1), r.step):
                    part = _read_rows(src, span, i, min(rows, i + r.step))
                    outs = (part,) if r.encode is None else r.encode(part)
                    for out, t in zip(r.outputs, outs):
                        assert tuple(t.shape[1:]) == r.outputs[out][1][1:] and t.dtype == r.outputs[out][0], out
                        _pwrite_all(dst, t, written[out])
                        written[out] += t.numel() * t.element_size()
                    del part, outs
        finally:
            os.close(dst)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(src)
