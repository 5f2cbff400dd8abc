"""The disk tier: weights read straight from the checkpoint's own safetensors files, at their header offsets.

Nothing is copied to another folder. A `SafetensorsReader` opens one file once, keeps its header (every
tensor's dtype, shape and byte span) and the file's identity (size, mtime, inode), and reads:

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

A file changed after it was opened (size, mtime or inode differ) or cut short is a `CheckpointError` at the
read, never garbage. `DensePrefetcher` reads a layer's dense tensors ahead on one worker thread into a
bounded pool of reusable buffers.
"""

from __future__ import annotations

import errno
import json
import math
import mmap
import os
import stat
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

from ..errors import CheckpointError

__all__ = ["SAFETENSORS_DTYPES", "DIRECT_ALIGN", "TensorSpan", "SafetensorsReader", "DensePrefetcher",
           "checkpoint_readers"]

# Safetensors dtype names -> torch dtypes (the ones torch can hold).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool, "U16": torch.uint16,
    "U32": torch.uint32, "U64": torch.uint64,
}
if hasattr(torch, "float8_e8m0fnu"):
    SAFETENSORS_DTYPES["F8_E8M0"] = torch.float8_e8m0fnu

DIRECT_ALIGN = 4096              # O_DIRECT offset, length and buffer alignment (covers 512 and 4K sectors)
DEFAULT_BOUNCE = 8 << 20         # O_DIRECT bounce buffer: reads larger than this take several calls
_MAX_HEADER = 100 << 20          # safetensors' own limit on the JSON header
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
_BUFFER_ALIGN = 64               # prefetch pool: each tensor starts on a cache line


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


def _parse_header(path: Path, fd: int, size: int) -> dict[str, TensorSpan]:
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{path}: not a readable safetensors file ({why}); the file is corrupt or "
                               "truncated, copy it again")

    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        raise bad(f"{size} bytes, shorter than the 8-byte header length")
    n = int.from_bytes(head, "little")
    if n > _MAX_HEADER or 8 + n > size:
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


class SafetensorsReader:
    """Reads tensors of one safetensors file at their header offsets; see the module docstring.

    `direct`: True requires O_DIRECT (an error where the filesystem refuses it), False uses buffered reads +
    POSIX_FADV_DONTNEED, None (default) takes O_DIRECT when the filesystem supports it. `bounce_bytes`:
    size of the O_DIRECT bounce buffer (a multiple of 4096). Thread-safe; O_DIRECT reads are serialised
    because they share the bounce buffer.
    """

    def __init__(self, path: str | os.PathLike, *, direct: bool | None = None, bounce_bytes: int = DEFAULT_BOUNCE):
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as exc:
            raise CheckpointError(f"{self.path}: cannot open the checkpoint file ({exc.strerror}); check the "
                                  "path and its permissions") from exc
        self._direct_fd: int | None = None
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.read_calls = 0
        try:
            st = os.fstat(self._fd)
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"{self.path} is not a regular file: the disk tier reads safetensors files")
            self._identity = _Identity.of(st)
            self.tensors: Mapping[str, TensorSpan] = _parse_header(self.path, self._fd, st.st_size)
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
                self._bounce = mmap.mmap(-1, bounce_bytes)  # anonymous mappings are page aligned
                self._bounce_view = memoryview(self._bounce)
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
            return (f"O_DIRECT (page cache bypassed; {DIRECT_ALIGN}-byte aligned reads through a "
                    f"{len(self._bounce)}-byte bounce buffer)")
        return "posix_fadvise DONTNEED (buffered reads into the destination; page cache released after each read)"

    @property
    def bounce_bytes(self) -> int:
        return len(self._bounce) if self.direct else 0

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
            with self._lock:
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
        lo = offset // DIRECT_ALIGN * DIRECT_ALIGN
        hi = -(-(offset + total) // DIRECT_ALIGN) * DIRECT_ALIGN
        bounce = self._bounce_view
        di, dpos = 0, 0          # destination index and the bytes of it already filled
        pos = offset             # next file byte to deliver
        for win in range(lo, hi, len(bounce)):
            n = min(len(bounce), hi - win)
            got = os.preadv(self._direct_fd, [bounce[:n]], win)
            self.bytes_read += got      # under self._lock (held by _read_pieces)
            self.read_calls += 1
            need = min(win + n, offset + total) - win   # bytes of this window the caller needs (the rest: EOF)
            if got < need:
                raise self._short(offset, total, max(0, win + got - offset))
            # Copy this window's part of [offset, offset + total) into the destinations, in order.
            while di < len(dests) and pos < win + n and pos < offset + total:
                d = dests[di]
                take = min(len(d) - dpos, win + n - pos)
                d[dpos:dpos + take] = bounce[pos - win:pos - win + take]
                dpos += take
                pos += take
                if dpos == len(d):
                    di, dpos = di + 1, 0
        if pos != offset + total:
            raise self._short(offset, total, pos - offset)

    def close(self) -> None:
        for attr in ("_direct_fd", "_fd"):
            fd = getattr(self, attr, None)
            if fd is not None and fd >= 0:
                os.close(fd)
            setattr(self, attr, -1 if attr == "_fd" else None)
        bounce = getattr(self, "_bounce", None)
        if bounce is not None:
            self._bounce_view.release()
            bounce.close()
            self._bounce = None

    def __enter__(self) -> "SafetensorsReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def checkpoint_readers(folder: str | os.PathLike, *, direct: bool | None = None, bounce_bytes: int = DEFAULT_BOUNCE
                       ) -> tuple[dict[str, SafetensorsReader], list[SafetensorsReader]]:
    """(checkpoint key -> its file's reader, the readers) for a model folder: one reader per safetensors
    file, opened once. The caller closes the readers."""
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
    try:
        for path in files:
            readers.append(SafetensorsReader(path, direct=direct, bounce_bytes=bounce_bytes))
    except BaseException:
        for r in readers:
            r.close()
        raise
    by_key = {key: r for r in readers for key in r.tensors}
    return by_key, readers


# ---------------------------------------------------------------------------------------------
# Reading the next layer's dense tensors ahead


class DensePrefetcher:
    """Reads decoder layers' dense disk-tier tensors one layer ahead, on one worker thread.

    `layers[i]` lists layer i's tensors as (reader, name). The pool is two slots (the layer in use, the layer
    being read), each sized for the largest layer with every tensor 64-byte aligned: `pool_bytes` is exact and
    allocated once (by `allocate(nbytes)`, default plain host memory; pass a pinned allocator on an
    accelerator). `get(i)` returns layer i's tensors (name -> tensor viewing the pool), valid until the next
    `get`, and starts reading layer i + 1 (wrapping to 0 after the last layer: the next token's first layer).
    A worker's exception is raised by the `get` that needs its result. `close()` waits for the worker.
    """

    def __init__(self, layers: Sequence[Sequence[tuple[SafetensorsReader, str]]], *,
                 allocate: Callable[[int], torch.Tensor] | None = None):
        self._layers = [list(group) for group in layers]
        if not self._layers:
            raise ValueError("DensePrefetcher needs at least one layer")
        self._offsets: list[dict[str, int]] = []
        slot = 0
        for group in self._layers:
            offsets, cursor = {}, 0
            for reader, name in group:
                cursor = -(-cursor // _BUFFER_ALIGN) * _BUFFER_ALIGN
                offsets[name] = cursor
                cursor += reader.span(name).nbytes
            self._offsets.append(offsets)
            slot = max(slot, cursor)
        self.slot_bytes = slot
        make = allocate or (lambda n: torch.empty(n, dtype=torch.uint8))
        self._slots = [make(slot) for _ in range(2)]
        for buf in self._slots:
            if buf.dtype != torch.uint8 or buf.numel() != slot or not buf.is_contiguous():
                raise ValueError(f"allocate({slot}) must return a contiguous uint8 tensor of {slot} elements")
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moe-offload-disk")
        self._pending: tuple[int, int, Future] | None = None    # (layer, slot, read)
        self._current = 1                                        # slot handed out last
        self._closed = False
        self.layers_read = 0

    @property
    def pool_bytes(self) -> int:
        return sum(b.numel() for b in self._slots)

    def _views(self, layer: int, slot: int) -> dict[str, torch.Tensor]:
        buf = self._slots[slot]
        out = {}
        for reader, name in self._layers[layer]:
            span = reader.span(name)
            off = self._offsets[layer][name]
            out[name] = buf[off:off + span.nbytes].view(span.dtype).view(span.shape)
        return out

    def _read(self, layer: int, slot: int) -> None:
        for (reader, name), view in zip(self._layers[layer], self._views(layer, slot).values()):
            reader.read(name, out=view)
        self.layers_read += 1

    def get(self, layer: int) -> dict[str, torch.Tensor]:
        if self._closed:
            raise RuntimeError("DensePrefetcher is closed")
        if not 0 <= layer < len(self._layers):
            raise IndexError(f"layer {layer} of {len(self._layers)}")
        pending, self._pending = self._pending, None
        slot = None
        if pending is not None:
            got, got_slot, fut = pending
            fut.result()            # re-raises the worker's exception here, in the caller
            if got == layer:
                slot = got_slot
        if slot is None:            # not read ahead (first call, or out of order): read it now, on the worker
            slot = self._current
            self._pool.submit(self._read, layer, slot).result()
        self._current = slot
        nxt, other = (layer + 1) % len(self._layers), 1 - slot
        self._pending = (nxt, other, self._pool.submit(self._read, nxt, other))
        return self._views(layer, slot)

    def close(self) -> None:
        """Stop: wait for the read in flight (its error, if any, is dropped: nothing will use it)."""
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pending = None

    def __enter__(self) -> "DensePrefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
