"""The disk tier: weights read straight from the checkpoint's own safetensors files, at their header offsets.

Nothing is copied to another folder. A `SafetensorsReader` opens one file once, keeps its header (every
tensor's dtype, shape and byte span: formats/safetensors.py's `TensorSpan`) and the file's identity (size,
mtime, inode), and reads:

- a whole tensor into a caller's buffer (`read`);
- several whole tensors (`read_tensors`): the per-expert layout transformers' loaders convert from
  (`...experts.7.gate_proj.weight`, one contiguous tensor per expert and matrix);
- selected experts of a fused tensor (`read_experts`): save_pretrained's fused layout `[E, ...]` (gpt-oss,
  GraniteMoE, Qwen3-VL-MoE) keeps each expert's block contiguous, also where the matrices inside are stored
  transposed relative to memory (gpt-oss `[E, in, out]`, released Qwen3-VL-MoE `[E, H, 2I]`): the block is
  read as stored and the caller transposes it. An expert dimension other than the first would make each
  expert strided; `dim=` reads it as one range per leading index, and `expert_ranges` says exactly which.

Byte ranges that touch in the file are read by one call (`os.preadv` scattering into the destinations), so
adjacent experts cost one read. Reads bypass or release the page cache so that memory is bounded by the plan
and the times are the disk's: `O_DIRECT` where the filesystem takes it (4096-byte aligned reads of the
aligned superset into a reused, aligned bounce buffer, then copied out), else buffered reads straight into
the destination followed by `posix_fadvise(POSIX_FADV_DONTNEED)`; `mechanism` says which. `bytes_read`
(bytes the disk delivered, alignment included) and `read_calls` count every read.

O_DIRECT reads go through bounce buffers taken from a `BouncePool` (bounce.py): one read holds one buffer, so a pool of N
buffers lets N reads be in flight at once (a disk serves several requests in flight faster than one at a time:
measured here, 1 MiB random O_DIRECT reads, 1.4 GB/s one at a time against 2.3-3.0 GB/s with 4-8 in flight).
`checkpoint_readers(..., in_flight=N)` gives every reader of a model one shared pool of N buffers, so the
bounce memory is N buffers whatever the number of files; a reader opened alone has its own pool of one.

A file changed after it was opened (size, mtime or inode differ) or cut short is a `CheckpointError` at the
read, never garbage. `checkpoint_readers` opens one reader per file of a model folder; disk_prefetch.py's
`DensePrefetcher` reads a layer's dense tensors ahead with them.
"""

from __future__ import annotations

import errno
import json
import math
import mmap
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import torch

from ..errors import CheckpointError
from ..formats.safetensors import TensorSpan, parse_header
from .bounce import DEFAULT_BOUNCE, DIRECT_ALIGN, BouncePool
from .clib import copy_bytes

__all__ = ["DIRECT_ALIGN", "BouncePool", "SafetensorsReader", "checkpoint_readers"]

_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


@dataclass(frozen=True)
class _Identity:
    size: int
    mtime_ns: int
    inode: int
    device: int

    @classmethod
    def of(cls, st: os.stat_result) -> "_Identity":
        return cls(st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


class SafetensorsReader:
    """Reads tensors of one safetensors file at their header offsets; see the module docstring.

    `direct`: True requires O_DIRECT (an error where the filesystem refuses it), False uses buffered reads +
    POSIX_FADV_DONTNEED, None (default) takes O_DIRECT when the filesystem supports it. `bounce_bytes`:
    size of the O_DIRECT bounce buffer (a multiple of 4096); `bounce`: a pool shared with other readers (its size
    wins), else the reader makes its own pool of one buffer. Thread-safe: as many O_DIRECT reads run at once as
    the pool has buffers.
    """

    def __init__(self, path: str | os.PathLike, *, direct: bool | None = None, bounce_bytes: int = DEFAULT_BOUNCE,
                 bounce: BouncePool | None = None):
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as exc:
            raise CheckpointError(f"{self.path}: cannot open the checkpoint file ({exc.strerror}); check the "
                                  "path and its permissions") from exc
        self._direct_fd: int | None = None
        self._pool: BouncePool | None = None
        self._own_pool = False
        self._lock = threading.Lock()         # the counters
        self.bytes_read = 0
        self.read_calls = 0
        try:
            st = os.fstat(self._fd)
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"{self.path} is not a regular file: the disk tier reads safetensors files")
            self._identity = _Identity.of(st)
            self.tensors: Mapping[str, TensorSpan] = parse_header(self.path, self._fd, st.st_size)
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the header pages too
            if direct is not False:
                if bounce_bytes < DIRECT_ALIGN or bounce_bytes % DIRECT_ALIGN:
                    raise ValueError(f"bounce_bytes={bounce_bytes} must be a positive multiple of {DIRECT_ALIGN}")
                try:
                    if not hasattr(os, "O_DIRECT"):
                        raise OSError(errno.EINVAL, "this platform has no O_DIRECT")
                    self._direct_fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
                except OSError as exc:
                    if direct:   # asked for explicitly: say why it cannot be had
                        raise CheckpointError(
                            f"{self.path}: the filesystem refuses O_DIRECT ({exc.strerror}); read with "
                            "direct=False (buffered reads, page cache released after each read)") from exc
            if self._direct_fd is not None:
                if _Identity.of(os.fstat(self._direct_fd)) != self._identity:
                    raise CheckpointError(f"{self.path} changed while it was being opened; open it again")
                self._own_pool = bounce is None
                self._pool = bounce if bounce is not None else BouncePool(bounce_bytes, 1)
            else:
                # Readahead would pull neighbouring bytes (other experts) into the page cache: read what is asked.
                os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)
        except BaseException:
            self.close()
            raise

    # --- description ------------------------------------------------------------------------

    @property
    def direct(self) -> bool:
        return self._direct_fd is not None

    @property
    def mechanism(self) -> str:
        if self.direct:
            return (f"O_DIRECT (page cache bypassed; {DIRECT_ALIGN}-byte aligned reads through "
                    f"{self._pool.slots} bounce buffer(s) of {self._pool.size} bytes, one per read in flight)")
        return "posix_fadvise DONTNEED (buffered reads into the destination; page cache released after each read)"

    @property
    def bounce_bytes(self) -> int:
        """Bounce memory this reader's own pool holds (a shared pool's is counted once, by its owner)."""
        return self._pool.bytes if self.direct and self._own_pool else 0

    @property
    def bounce_pool(self) -> BouncePool | None:
        return self._pool

    def span(self, name: str) -> TensorSpan:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.path} holds no tensor {name!r}; the checkpoint does not match the plan "
                                  "that put it on the disk tier, plan again for this checkpoint") from None

    def expert_ranges(self, name: str, experts: Sequence[int], *, dim: int = 0) -> list[tuple[int, int]]:
        """The (file offset, length) of every read `read_experts(name, experts, dim=dim)` makes, before
        O_DIRECT alignment: one per run of consecutive experts for dim 0, one per run and leading index else."""
        return [(off, sum(len(d) for d in dests)) for off, dests in self._coalesce(self._expert_pieces(
            self.span(name), experts, dim, None))]

    # --- reads --------------------------------------------------------------------------------

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The whole tensor `name`, into `out` (contiguous CPU, same dtype and element count) or a new tensor."""
        span = self.span(name)
        out = self._destination(span, span.shape, out)
        self._read_pieces([(span.start, _bytes_of(out))])
        return out

    def read_tensors(self, names: Sequence[str], outs: Sequence[torch.Tensor | None] | None = None
                     ) -> list[torch.Tensor]:
        """Several whole tensors (e.g. the selected experts' per-expert matrices); those that touch in the
        file are read together, one call per contiguous run."""
        outs = list(outs) if outs is not None else [None] * len(names)
        if len(outs) != len(names) or len(set(names)) != len(names):
            raise ValueError("read_tensors needs distinct names and one output (or None) per name")
        result = [self._destination(self.span(n), self.span(n).shape, o) for n, o in zip(names, outs)]
        self._read_pieces([(self.span(n).start, _bytes_of(t)) for n, t in zip(names, result)])
        return result

    def read_experts(self, name: str, experts: Sequence[int], out: torch.Tensor | None = None, *,
                     dim: int = 0) -> torch.Tensor:
        """Experts `experts` (distinct ids, any order) of the fused tensor `name` whose dimension `dim` indexes
        experts: `out[..., j, ...]` (at `dim`) receives expert `experts[j]`. One read per run of consecutive ids
        (per leading index where dim > 0)."""
        span = self.span(name)
        if not 0 <= dim < len(span.shape):
            raise ValueError(f"{name} has shape {list(span.shape)}: no expert dimension {dim}")
        shape = list(span.shape)
        shape[dim] = len(experts)
        out = self._destination(span, tuple(shape), out)
        self._read_pieces(self._expert_pieces(span, experts, dim, out))
        return out

    # --- internals ----------------------------------------------------------------------------

    @staticmethod
    def _destination(span: TensorSpan, shape: tuple[int, ...], out: torch.Tensor | None) -> torch.Tensor:
        if out is None:
            return torch.empty(shape, dtype=span.dtype)
        if out.device.type != "cpu" or not out.is_contiguous() or out.dtype != span.dtype \
                or out.numel() != math.prod(shape):
            raise ValueError(f"{span.name}: the output must be a contiguous CPU {span.dtype} tensor of "
                             f"{math.prod(shape)} elements (shape {list(shape)}); got {out.dtype} "
                             f"{list(out.shape)} on {out.device}")
        return out

    @staticmethod
    def _expert_pieces(span: TensorSpan, experts: Sequence[int], dim: int, out: torch.Tensor | None
                       ) -> list[tuple[int, memoryview | range]]:
        n = span.shape[dim]
        ids = [int(e) for e in experts]
        if len(set(ids)) != len(ids) or any(not 0 <= e < n for e in ids):
            raise ValueError(f"{span.name}: expert ids {ids} must be distinct and in [0, {n})")
        outer = math.prod(span.shape[:dim])
        inner = math.prod(span.shape[dim + 1:]) * span.dtype.itemsize   # bytes of one expert per leading index
        rows = out.reshape(outer, len(ids), -1) if out is not None else None
        pieces = []
        for o in range(outer):
            for j, e in enumerate(ids):
                dest = _bytes_of(rows[o, j]) if rows is not None else range(inner)  # range: length only
                pieces.append((span.start + (o * n + e) * inner, dest))
        return pieces

    @staticmethod
    def _coalesce(pieces):
        """[(offset, [dest, ...])] runs: pieces sorted by offset, those that touch merged."""
        runs: list[tuple[int, list]] = []
        end = None
        for off, dest in sorted(pieces, key=lambda p: p[0]):
            if len(dest) == 0:
                continue
            if runs and off == end:
                runs[-1][1].append(dest)
            else:
                runs.append((off, [dest]))
            end = off + len(dest)
        return runs

    def _check_unchanged(self) -> None:
        try:
            now = _Identity.of(os.stat(self.path))
            fd_now = _Identity.of(os.fstat(self._fd))
        except OSError as exc:
            raise CheckpointError(f"{self.path} is gone since it was opened ({exc.strerror}); the disk tier reads "
                                  "the checkpoint in place: restore it and load the model again") from exc
        if now != self._identity or fd_now != self._identity:
            was, is_ = self._identity, now if now != self._identity else fd_now
            raise CheckpointError(
                f"{self.path} changed after it was opened (size {was.size} -> {is_.size} bytes, mtime "
                f"{was.mtime_ns} -> {is_.mtime_ns} ns, inode {was.inode} -> {is_.inode}); its disk-tier tensors "
                "would be read from a different file: load the model again")

    def _short(self, offset: int, want: int, got: int) -> CheckpointError:
        return CheckpointError(f"{self.path}: read of {want} bytes at offset {offset} returned {got}: the file is "
                               "truncated; copy the checkpoint again and load the model again")

    def _read_pieces(self, pieces) -> None:
        if self._fd < 0:
            raise CheckpointError(f"{self.path}: reader is closed")
        self._check_unchanged()
        runs = self._coalesce(pieces)
        if self.direct:
            for off, dests in runs:
                self._read_direct(off, dests)
        else:
            for off, dests in runs:
                self._read_buffered(off, dests)

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_read += nbytes
            self.read_calls += 1

    def _read_buffered(self, offset: int, dests: list[memoryview]) -> None:
        total = sum(len(d) for d in dests)
        pos, i = offset, 0
        dests = list(dests)
        while i < len(dests):
            got = os.preadv(self._fd, dests[i:i + _IOV_MAX], pos)
            self._count(got)
            if got == 0:
                raise self._short(offset, total, pos - offset)
            pos += got
            # Skip the buffers filled completely; continue inside a partly filled one.
            while got and i < len(dests):
                if got >= len(dests[i]):
                    got -= len(dests[i])
                    i += 1
                else:
                    dests[i] = dests[i][got:]
                    got = 0
        # Release exactly the pages this read brought in (rounded out to whole pages).
        page = mmap.PAGESIZE
        lo = offset // page * page
        os.posix_fadvise(self._fd, lo, -(-(offset + total) // page) * page - lo, os.POSIX_FADV_DONTNEED)

    def _read_direct(self, offset: int, dests: list[memoryview]) -> None:
        total = sum(len(d) for d in dests)
        item = self._pool.take()
        try:
            self._read_direct_through(offset, dests, total, item[1], item[2])
        finally:
            self._pool.give(item)

    def _read_direct_through(self, offset: int, dests: list[memoryview], total: int, bounce: memoryview,
                             source: torch.Tensor) -> None:
        lo = offset // DIRECT_ALIGN * DIRECT_ALIGN
        hi = -(-(offset + total) // DIRECT_ALIGN) * DIRECT_ALIGN
        dests = [torch.frombuffer(d, dtype=torch.uint8) for d in dests]   # no copy: the callers' memory
        di, dpos = 0, 0          # destination index and the bytes of it already filled
        pos = offset             # next file byte to deliver
        for win in range(lo, hi, len(bounce)):
            n = min(len(bounce), hi - win)
            got = os.preadv(self._direct_fd, [bounce[:n]], win)
            self._count(got)
            need = min(win + n, offset + total) - win   # bytes of this window the caller needs (the rest: EOF)
            if got < need:
                raise self._short(offset, total, max(0, win + got - offset))
            # Copy this window's part of [offset, offset + total) into the destinations, in order.
            while di < len(dests) and pos < win + n and pos < offset + total:
                d = dests[di]
                take = min(d.numel() - dpos, win + n - pos)
                copy_bytes(d[dpos:dpos + take], source[pos - win:pos - win + take])   # no OpenMP team here
                dpos += take
                pos += take
                if dpos == d.numel():
                    di, dpos = di + 1, 0
        if pos != offset + total:
            raise self._short(offset, total, pos - offset)

    def close(self) -> None:
        for attr in ("_direct_fd", "_fd"):
            fd = getattr(self, attr, None)
            if fd is not None and fd >= 0:
                os.close(fd)
            setattr(self, attr, -1 if attr == "_fd" else None)
        pool = getattr(self, "_pool", None)
        if pool is not None and getattr(self, "_own_pool", False):
            pool.close()
        self._pool = None

    def __enter__(self) -> "SafetensorsReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def checkpoint_readers(folder: str | os.PathLike, *, direct: bool | None = None, bounce_bytes: int = DEFAULT_BOUNCE,
                       reader: type | None = None, in_flight: int = 1
                       ) -> tuple[dict[str, SafetensorsReader], list[SafetensorsReader]]:
    """(checkpoint key -> its file's reader, the readers) for a model folder: one reader per safetensors
    file, opened once (`reader`: another SafetensorsReader class, e.g. mapped.MappedReader), all O_DIRECT ones
    sharing one pool of `in_flight` bounce buffers (counted in the first reader's `bounce_bytes`). The caller
    closes the readers (the first one last closes the pool)."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index} is malformed ({exc}); it must hold a 'weight_map' object") from exc
        files = [folder / n for n in names]
    if not files:
        raise CheckpointError(f"{folder} holds no safetensors files: the disk tier reads the checkpoint in place")
    readers: list[SafetensorsReader] = []
    pool = BouncePool(bounce_bytes, in_flight)
    try:
        for path in files:
            readers.append((reader or SafetensorsReader)(path, direct=direct, bounce=pool))
    except BaseException:
        for r in readers:
            r.close()
        pool.close()
        raise
    if readers and readers[0].direct:
        readers[0]._own_pool = True        # the pool's memory counted once; closed with the first reader
    by_key = {key: r for r in readers for key in r.tensors}
    return by_key, readers
