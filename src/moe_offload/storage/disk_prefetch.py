"""The disk tier's dense tensors read ahead: `DensePrefetcher` reads the next decoder layer's dense tensors from
the checkpoint (disk.py's readers) on one worker thread, into a bounded pool of reusable buffers.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

import torch

from .disk import SafetensorsReader

__all__ = ["DensePrefetcher"]

_BUFFER_ALIGN = 64               # prefetch pool: each tensor starts on a cache line


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
