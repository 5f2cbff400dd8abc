"""One in-memory tensor held on the disk tier: where its bytes lie in the checkpoint, and how its rows are read.

A `DiskTensor` is filled by one or more checkpoint tensors (`pieces`: reader + formats.layouts.Slot, as the
loader maps them): one per expert, or one fused `[E, ...]` tensor read by runs of consecutive expert ids, each
converted as the loader converts it (transposed where its slot says, dtype changed where --dtype asks).
run/disk_tier.py reads through it at run time.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import torch

from .disk import SafetensorsReader
from ..errors import CheckpointError
from ..formats.layouts import Slot


@dataclass(frozen=True)
class DiskTensor:
    """One in-memory tensor held on the disk tier: its full shape and dtype, and where its bytes are."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[tuple[SafetensorsReader, Slot], ...]
    experts: int | None          # E for a routed-expert tensor [E, ...] read by expert, else None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize

    @property
    def prefetchable(self) -> bool:
        """Read as stored in one piece (no transpose, concatenation or dtype change): a prefetch slot's view
        of the stored bytes is the tensor itself."""
        if len(self.pieces) != 1:
            return False
        reader, slot = self.pieces[0]
        span = reader.span(slot.key)
        return slot.is_whole and slot.transpose is None and span.dtype == self.dtype and span.shape == self.shape

    def read_rows(self, ids: Sequence[int], out: torch.Tensor, pool: ThreadPoolExecutor | None = None) -> None:
        """out[j] = this tensor's row ids[j] (expert or table row), for a contiguous CPU `out` [len(ids), ...].

        `pool`: the selected experts' reads (one per expert and file) are issued on it concurrently: the disk
        serves several requests in flight faster than one at a time (O_DIRECT reads: as many at once as the
        readers' bounce pool has buffers)."""
        ids = [int(e) for e in ids]
        pos = {e: j for j, e in enumerate(ids)}
        batched: dict[tuple[int, int], tuple[SafetensorsReader, list[str], list[torch.Tensor]]] = {}
        for reader, slot in self.pieces:
            if slot.expert is not None:                  # one checkpoint tensor per expert
                j = pos.get(slot.expert)
                if j is None:
                    continue
                dst = _part(out[j], slot)
                if _direct(reader, slot, dst):           # read straight into its place, coalesced per file
                    entry = batched.setdefault((id(reader), j), (reader, [], []))
                    entry[1].append(slot.key)
                    entry[2].append(dst)
                else:
                    _convert_into(dst, reader.read(slot.key), slot)
            else:                                        # one checkpoint tensor spans every row
                if slot.parts > 1 and slot.part_dim == 0:
                    raise CheckpointError(f"checkpoint tensor {slot.key!r} is concatenated along the experts dim "
                                          f"of {self.name}; the disk tier cannot read its experts apart: keep "
                                          "it on the host or device")
                dst = out
                if slot.parts > 1:
                    size = out.shape[slot.part_dim + 1] // slot.parts
                    dst = out.narrow(slot.part_dim + 1, slot.part * size, size)
                span = reader.span(slot.key)
                if slot.transpose is None and span.dtype == out.dtype and dst.is_contiguous():
                    reader.read_experts(slot.key, ids, out=dst)
                else:
                    _convert_into(dst, reader.read_experts(slot.key, ids), slot, leading=True)
        jobs = list(batched.values())
        if pool is not None and len(jobs) > 1:
            for done in [pool.submit(reader.read_tensors, keys, outs) for reader, keys, outs in jobs]:
                done.result()           # re-raises a read's CheckpointError here
        else:
            for reader, keys, outs in jobs:
                reader.read_tensors(keys, outs)

    def read_whole(self, out: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self.dtype) if out is None else out
        if self.experts is not None or any(s.expert is not None for _, s in self.pieces):
            self.read_rows(range(self.shape[0]), out)
            return out
        for reader, slot in self.pieces:
            dst = _part(out, slot)
            if _direct(reader, slot, dst):
                reader.read(slot.key, out=dst)
            else:
                _convert_into(dst, reader.read(slot.key), slot)
        return out


def _part(dst: torch.Tensor, slot: Slot) -> torch.Tensor:
    if slot.parts > 1:
        size = dst.shape[slot.part_dim] // slot.parts
        dst = dst.narrow(slot.part_dim, slot.part * size, size)
    return dst


def _direct(reader: SafetensorsReader, slot: Slot, dst: torch.Tensor) -> bool:
    span = reader.span(slot.key)
    return (dst.device.type == "cpu" and dst.is_contiguous() and span.dtype == dst.dtype
            and span.shape == tuple(dst.shape)
            and (slot.transpose is None or slot.transpose_if_needed))


def _convert_into(dst: torch.Tensor, src: torch.Tensor, slot: Slot, leading: bool = False) -> None:
    """As the loader writes a checkpoint tensor: transposed first where its slot says (only when it does not
    already fit, for transformers' check_dims), then copied (converting the dtype where --dtype asks)."""
    if slot.transpose is not None and not (slot.transpose_if_needed and tuple(src.shape) == tuple(dst.shape)):
        src = src.transpose(*slot.transpose)
    if tuple(src.shape) != tuple(dst.shape):
        raise CheckpointError(f"checkpoint tensor {slot.key!r} has shape {list(src.shape)} where its place in "
                              f"{slot.target} has {list(dst.shape)}; the checkpoint does not match config.json")
    dst.copy_(src)
