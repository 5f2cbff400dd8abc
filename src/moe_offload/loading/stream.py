"""Streaming a checkpoint into the tensors allocated for its plan (allocate.py): every checkpoint tensor is
read once, from its safetensors file, and written once into its slot.

Per-expert checkpoint tensors go straight into their slice of the fused in-memory tensor, and each expert
of a tensor split between tiers into the stack that holds it (storage/host.ExpertSplit). Quantized tensors
are written as stored, values and scales, never dequantized on the way (quant_weights.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn as nn

from ..errors import CheckpointError
from ..formats.layouts import map_keys
from ..model.checkpoint import read_headers, safetensors_files
from ..planning.placement import Tier
from ..run.quant_weights import checkpoint_owner
from ..storage.disk import SafetensorsReader
from ..storage.host import ExpertSplit, expert_runs

# O_DIRECT bounce buffer of the loader's reads: large sequential reads, freed when each file is done.
_LOAD_BOUNCE = 16 << 20


def _progress(enabled: bool):
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)
    from rich.console import Console

    return Progress(TextColumn("loading"), BarColumn(), DownloadColumn(binary_units=True), TransferSpeedColumn(),
                    TimeRemainingColumn(), console=Console(stderr=True), disable=not enabled, transient=True)


def stream_checkpoint(folder: Path, model: nn.Module, targets, splits, by_name, progress: bool, spec=None,
                       slots=None, quant=None, disk: set[str] = frozenset()) -> None:
    """Write every checkpoint tensor once into its place. `slots`: owner key -> Slot (quant_weights.
    checkpoint_owner); a quantized tensor's values and scales land in its two stored tensors (`quant`).
    Tensors in `disk` are not read (a disk-tier split tensor: only its resident experts).

    Files are read through disk.SafetensorsReader (O_DIRECT, or buffered reads whose pages are released after
    each read), in file order, straight into the destination when it is contiguous and needs no conversion:
    a memory-mapped shard would keep every page it touched resident while the model fills up (peak RSS about
    twice the checkpoint)."""
    quant = quant or {}
    files = safetensors_files(folder)
    if slots is None:
        slots = map_keys(model, read_headers(files).keys(), known=set(by_name))
    written: dict[str, int] = defaultdict(int)
    with _progress(progress) as bar:
        task = bar.add_task("load", total=sum(t.bytes for t in by_name.values()))
        for path in files:
            with SafetensorsReader(path, bounce_bytes=_LOAD_BOUNCE) as reader:
                for span in sorted(reader.tensors.values(), key=lambda sp: sp.start):
                    key = span.name
                    owner, is_scale = checkpoint_owner(key, spec)
                    slot = slots[owner]
                    q = quant.get(slot.target)
                    target = q.scale_name if (q is not None and is_scale) else slot.target
                    if target in disk and target not in splits:
                        continue                      # read at run time from this file (disk_tier.py)
                    if target not in targets and target not in splits:
                        raise CheckpointError(f"{path.name}: tensor {key!r} matches no tensor of the model; "
                                              "the checkpoint and config.json are for different models")
                    host = targets[target][0] if target in targets else None   # None: a disk-tier split
                    split = splits.get(target)
                    if split is not None and host is None and slot.expert is not None \
                            and slot.expert < split.num_experts \
                            and split.where(slot.expert)[0] == Tier.HOST.value:   # (out of range: refused below)
                        continue                      # this expert of a disk-tier split stays on disk
                    like = host if host is not None else split.resident
                    full_shape = by_name[target].shape if q is None else (q.scale_shape if is_scale else q.data_shape)
                    shape = tuple(_destination(torch.empty(full_shape, device="meta"), slot, key).shape)
                    stored = tuple(span.shape)
                    # transformers' Transpose(check_dims=True): transpose only when the tensor does not already fit.
                    transpose = slot.transpose is not None and not (getattr(slot, "transpose_if_needed", False)
                                                                    and stored == shape)
                    if transpose:
                        a, b = slot.transpose
                        stored = list(stored)
                        stored[a], stored[b] = stored[b], stored[a]
                        stored = tuple(stored)
                    if stored != shape:
                        raise CheckpointError(
                            f"{path.name}: {key!r} has shape {list(stored)}, but its place in "
                            f"{target} has shape {list(shape)}; the checkpoint does not match config.json")
                    if span.dtype.is_floating_point != like.is_floating_point():
                        raise CheckpointError(f"{path.name}: {key!r} is {span.dtype}, the model expects {like.dtype}; "
                                              "the checkpoint does not match config.json")
                    if q is not None and span.dtype != like.dtype:   # stored bytes are copied, never converted
                        raise CheckpointError(f"{path.name}: {key!r} is {span.dtype}, but {target} is held as "
                                              f"stored in {like.dtype} (the checkpoint's other parts of it); "
                                              "a tensor must be quantized whole: the checkpoint is inconsistent")
                    dst = (_destination(host, slot, key) if host.dim() else host) \
                        if split is None and not transpose else None
                    if dst is not None and dst.device.type == "cpu" and dst.is_contiguous() \
                            and dst.dtype == span.dtype:
                        reader.read(key, out=dst)     # straight into its place: no temporary
                    else:
                        src = reader.read(key)
                        if transpose:
                            src = src.transpose(*slot.transpose)
                        _write(host, split, slot, src, key)
                    numel = math.prod(span.shape)
                    if split is not None and host is None and slot.expert is None:   # a disk-tier split's fused
                        numel = numel // split.num_experts * split.resident.shape[0]  # tensor: its resident rows
                    written[target] += numel
                    bar.advance(task, numel * like.element_size())
    missing = [n for n, (host, _) in targets.items()
               if written.get(n, 0) != host.numel() + (splits[n].resident.numel() if n in splits else 0)
               and not (n in by_name and by_name[n].is_buffer)]
    missing += [n for n, sp in splits.items() if n not in targets and written.get(n, 0) != sp.resident.numel()]
    if missing:
        raise CheckpointError(f"{folder}: {len(missing)} tensor(s) not fully written by the checkpoint "
                              f"(first: {missing[:3]}); the checkpoint is incomplete")


def _write(host: torch.Tensor, split: ExpertSplit | None, slot, src: torch.Tensor, key: str) -> None:
    """Copy `src` once into its place: the target `host` (the tensor in its tier), or for a tensor split
    between tiers, each expert's row of the stack that holds it (split.where)."""
    if split is None:
        (_destination(host, slot, key) if host.dim() else host).copy_(src)
    elif slot.expert is None:   # one checkpoint tensor spans every expert: each stack takes its experts' rows
        if slot.parts > 1 and slot.part_dim == 0:
            raise CheckpointError(f"checkpoint tensor {key!r} is concatenated along the experts dim of "
                                  f"{slot.target}, which the plan splits by expert; offload it whole instead")
        for stack, ids in ((split.resident, split.resident_ids), (host, split.host_ids)):
            if stack is None:   # a disk-tier split: its disk experts stay in the checkpoint
                continue
            dst = _destination(stack, slot, key)
            for row, first, count in expert_runs(ids):
                dst[row:row + count].copy_(src[first:first + count])
    else:                       # one checkpoint tensor per expert (range checked against the full shape)
        tier, row = split.where(slot.expert)
        stack = host if tier == Tier.HOST else split.resident
        _destination(stack, dataclasses.replace(slot, expert=row), key).copy_(src)


def _destination(host: torch.Tensor, slot, key: str) -> torch.Tensor:
    dst = host
    if slot.expert is not None:
        if slot.expert >= dst.shape[0]:
            raise CheckpointError(f"checkpoint tensor {key!r} is expert {slot.expert}, but {slot.target} holds "
                                  f"{dst.shape[0]} experts; the checkpoint does not match config.json")
        dst = dst[slot.expert]
    if slot.parts > 1:
        size = dst.shape[slot.part_dim] // slot.parts
        dst = dst.narrow(slot.part_dim, slot.part * size, size)
    return dst
