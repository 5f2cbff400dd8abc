"""make-tiny's on-disk departures from save_pretrained, toward what the released checkpoints store.

`transpose_in_place` swaps the last two dims of named 3-d tensors of saved safetensors files, in place and one
tensor at a time (families.RELEASED_TRANSPOSED: Qwen3-VL-MoE's fused experts, which transformers writes in its
in-memory orientation and the released checkpoints store transposed). A transpose permutes a shape's numbers,
so the JSON header keeps its length and every tensor its byte range: only the header and those tensors' bytes
are rewritten, and the file stays byte-identical to what safetensors writes for the transposed tensors.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import torch

from ..formats.safetensors import parse_header
from ..formats.stream_save import shard_header

__all__ = ["transpose_in_place"]


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _metadata(fd: int) -> dict[str, str] | None:
    n = int.from_bytes(os.pread(fd, 8, 0), "little")
    return json.loads(os.pread(fd, n, 8)).get("__metadata__")


def transpose_in_place(folder: str | os.PathLike, suffixes: Sequence[str]) -> list[str]:
    """Store every 3-d tensor whose name ends in one of `suffixes`, in each safetensors file of `folder`, as
    [d0, d2, d1] instead of [d0, d1, d2]. Returns the names rewritten. The index (names -> files, total size)
    is unchanged by a transpose."""
    done: list[str] = []
    for path in sorted(Path(folder).glob("*.safetensors")):
        fd = os.open(path, os.O_RDWR)
        try:
            spans = parse_header(path, fd, os.fstat(fd).st_size)
            targets = [s for s in spans.values() if s.name.endswith(tuple(suffixes)) and len(s.shape) == 3]
            if not targets:
                continue
            shapes = {s.name: (s.dtype, s.shape) for s in spans.values()}
            for s in targets:
                shapes[s.name] = (s.dtype, (s.shape[0], s.shape[2], s.shape[1]))
            head, new_spans = shard_header(shapes, _metadata(fd))
            data_start = min(s.start for s in spans.values())
            if len(head) != data_start or any(
                    data_start + new_spans[s.name][0] != s.start for s in spans.values()):
                raise RuntimeError(f"{path}: transposing {targets[0].name} moved the tensors' bytes; "
                                   "this safetensors layout is not the one make-tiny writes")
            for s in targets:
                raw = bytearray(os.pread(fd, s.nbytes, s.start))
                t = torch.frombuffer(raw, dtype=s.dtype).view(s.shape)
                _pwrite_all(fd, t.transpose(1, 2).contiguous().reshape(-1).view(torch.uint8).numpy(), s.start)
                del raw, t
                done.append(s.name)
            _pwrite_all(fd, head, 0)
        finally:
            os.close(fd)
    return done
