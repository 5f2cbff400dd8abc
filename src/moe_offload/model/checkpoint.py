"""A checkpoint's safetensors files as the inventory reads them: which files, their headers, slot shapes.

Headers alone: no tensor data is read. `safetensors_files` lists a folder's shards (a shard its index names
but the folder lacks is an error), `read_headers` gives each checkpoint key's file, dtype and shape, and the
slot shapes say what shape a checkpoint tensor must have to fill its place in an in-memory tensor
(formats/layouts.py's Slot).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import CheckpointError

# Bytes per element of the dtypes a safetensors header can name.
ST_DTYPES = {"F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
              "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1), "I64": ("int64", 8),
              "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1), "BOOL": ("bool", 1)}
# Checkpoint suffixes of quantized storage that belong to another tensor.
QUANT_SUFFIXES = ("_blocks", "_scales", ".weight_scale_inv", "_scale_inv", ".weight_scale")


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's shard files; a missing shard named by the index is an error."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} is malformed ({exc}); it must hold a 'weight_map' object") from exc
        files = sorted({folder / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(
                f"{folder}: shard(s) {', '.join(missing)} named by {index.name} are missing; "
                "the checkpoint is incomplete, copy the missing files")
        return files
    return sorted(folder.glob("*.safetensors"))


def read_headers(files) -> dict[str, tuple[Path, str, tuple[int, ...]]]:
    """key -> (file, safetensors dtype, shape), from the headers alone."""
    from safetensors import safe_open

    out = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    out[key] = (path, sl.get_dtype(), tuple(sl.get_shape()))
        except Exception as exc:  # safetensors raises SafetensorError for bad headers and truncation
            raise CheckpointError(f"{path}: not a readable safetensors file ({exc}); the file is corrupt or "
                                  "truncated, copy it again") from exc
    return out


def slot_shape(slot, shape: tuple[int, ...], expected: tuple[int, ...]) -> tuple[int, ...]:
    """A checkpoint tensor's shape once its slot's transpose is applied."""
    shape = list(shape)
    if slot.transpose is not None and not (slot.transpose_if_needed and tuple(shape) == expected):
        i, j = slot.transpose
        shape[i], shape[j] = shape[j], shape[i]
    return tuple(shape)


def expected_slot_shape(slot, full: tuple[int, ...]) -> tuple[int, ...]:
    """The shape a checkpoint tensor must have to fill its slot of an in-memory tensor of shape `full`."""
    shape = list(full[1:] if slot.expert is not None else full)
    if slot.parts > 1 and 0 <= slot.part_dim < len(shape):
        shape[slot.part_dim] //= slot.parts
    return tuple(shape)
