"""The safetensors on-disk format: its dtype names, and a file's header parsed into tensor byte spans.

A safetensors file is an 8-byte little-endian header length, a JSON header (tensor name -> dtype, shape and
`data_offsets` within the data that follows; an optional `__metadata__`), then the tensors' bytes. The
streaming writer (stream_save.py) names dtypes from `SAFETENSORS_DTYPES`; the disk tier's reader
(storage/disk.py) finds each tensor's absolute byte range with `parse_header`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CheckpointError

__all__ = ["SAFETENSORS_DTYPES", "MAX_HEADER", "TensorSpan", "parse_header"]

# Safetensors dtype names -> torch dtypes (the ones torch can hold).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool, "U16": torch.uint16,
    "U32": torch.uint32, "U64": torch.uint64,
}
if hasattr(torch, "float8_e8m0fnu"):
    SAFETENSORS_DTYPES["F8_E8M0"] = torch.float8_e8m0fnu

MAX_HEADER = 100 << 20          # safetensors' own limit on the JSON header


@dataclass(frozen=True)
class TensorSpan:
    """One tensor of a safetensors file: its absolute byte range [start, end)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def parse_header(path: Path, fd: int, size: int) -> dict[str, TensorSpan]:
    """Every tensor of the open safetensors file `fd` (`size` bytes, named `path` in errors): name -> its span.
    A header that is not safetensors, or a span that does not fit its shape or the file, is a CheckpointError."""
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{path}: not a readable safetensors file ({why}); the file is corrupt or "
                               "truncated, copy it again")

    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        raise bad(f"{size} bytes, shorter than the 8-byte header length")
    n = int.from_bytes(head, "little")
    if n > MAX_HEADER or 8 + n > size:
        raise bad(f"header length {n} does not fit the file's {size} bytes")
    raw = os.pread(fd, n, 8)
    if len(raw) < n:
        raise bad(f"header cut short: {len(raw)} of {n} bytes")
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad(f"header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    base = 8 + n
    spans: dict[str, TensorSpan] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = SAFETENSORS_DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise bad(f"entry {name!r} is malformed or has an unknown dtype ({exc!r})") from exc
        if end - begin != math.prod(shape) * dtype.itemsize or begin < 0 or base + end > size:
            raise bad(f"{name!r} spans bytes [{begin}, {end}) for shape {list(shape)} {info['dtype']}, which "
                      f"does not match its size or lies beyond the file's {size} bytes")
        spans[name] = TensorSpan(name, dtype, shape, base + begin, base + end)
    return spans
