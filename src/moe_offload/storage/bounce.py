"""Bounce buffers for O_DIRECT reads: page-aligned memory that a read lands in before it is copied out.

O_DIRECT needs the offset, the length and the buffer aligned (`DIRECT_ALIGN`); a checkpoint's tensors start
wherever the safetensors header says, so disk.py's readers read the aligned superset of a byte range into a
bounce buffer and copy the range out. One read holds one buffer, so a `BouncePool` of N buffers lets N reads be
in flight at once, and the bounce memory is N buffers whatever the number of files or threads.
"""

from __future__ import annotations

import mmap
import threading

import torch

__all__ = ["DIRECT_ALIGN", "DEFAULT_BOUNCE", "BouncePool"]

DIRECT_ALIGN = 4096              # O_DIRECT offset, length and buffer alignment (covers 512 and 4K sectors)
DEFAULT_BOUNCE = 8 << 20         # O_DIRECT bounce buffer: reads larger than this take several calls


class BouncePool:
    """`slots` page-aligned bounce buffers of `size` bytes for O_DIRECT reads, made when first needed and shared by
    the readers given it: `take()` blocks while all are in use (so at most `slots` reads are in flight),
    `give()` returns one. `bytes` is the memory made so far (at most size * slots)."""

    def __init__(self, size: int = DEFAULT_BOUNCE, slots: int = 1):
        if size < DIRECT_ALIGN or size % DIRECT_ALIGN:
            raise ValueError(f"bounce_bytes={size} must be a positive multiple of {DIRECT_ALIGN}")
        if slots < 1:
            raise ValueError(f"a bounce pool needs at least one slot, got {slots}")
        self.size, self.slots = size, slots
        self._free: list[tuple[mmap.mmap, memoryview, torch.Tensor]] = []
        self._made = 0
        self._ready = threading.Condition()

    @property
    def bytes(self) -> int:
        return self._made * self.size

    def take(self) -> tuple[mmap.mmap, memoryview, torch.Tensor]:
        with self._ready:
            while not self._free and self._made >= self.slots:
                self._ready.wait()
            if self._free:
                return self._free.pop()
            self._made += 1
        buf = mmap.mmap(-1, self.size)      # anonymous mappings are page aligned
        # The same bytes as a tensor: copies out of it are the C library's memmove (clib.copy_bytes), which releases
        # the GIL and starts no OpenMP team on the reader's thread (a memoryview slice assignment holds the GIL for the
        # whole memcpy, stalling every other thread's Python meanwhile).
        return buf, memoryview(buf), torch.frombuffer(buf, dtype=torch.uint8)

    def give(self, item: tuple[mmap.mmap, memoryview, torch.Tensor]) -> None:
        with self._ready:
            self._free.append(item)
            self._ready.notify()

    def close(self) -> None:
        """Unmap the buffers not in use (all of them once every read has finished)."""
        with self._ready:
            free, self._free = self._free, []
            self._made -= len(free)
        for buf, view, _ in free:
            view.release()
            buf.close()
